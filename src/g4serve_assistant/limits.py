"""Bounds on what one client may send the assistant that both the app and its flags need (standard library
only: ``g4serve --help`` builds the flags without the assistant extra)."""

# The largest request body (--max-request-body-bytes): a turn's audio is at most 30 s of WAV, ~1.3 MB as
# base64.
MAX_REQUEST_BODY_BYTES = 8 << 20
