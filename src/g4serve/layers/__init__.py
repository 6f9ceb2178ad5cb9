"""Small pure-torch building blocks shared by the text decoder and the encoders."""
