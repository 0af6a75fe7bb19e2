"""What the serve tests share besides the fixture (a unique module name: tests/ has no packages)."""
from __future__ import annotations

import socket

API_KEY = "test-key-123"
MAX_PROMPT_TOKENS = 1024
MAX_BODY_BYTES = 256 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODEL = "smollm2-135m-instruct"      # the default model's id: requests naming another model get 404
