"""Scale-out: data-parallel engine replicas behind a prefix-cache-aware, session-affine router.

``affinity`` (what a request shares with others) and ``router`` (which replica gets it) are the policy, pure
Python; ``proxy`` is the standalone HTTP router (``g4serve router``), ``ray_app`` the Ray Serve application
(``g4serve serve --ray``). See docs/deploy.md.
"""
