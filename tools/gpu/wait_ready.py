"""Waits until the server on 127.0.0.1:PORT answers /health with 200 (exit 0), or DEADLINE seconds
pass (exit 1): readiness, not a guess.

    python3 tools/gpu/wait_ready.py PORT [DEADLINE]
"""

import sys
import time

import httpx


def main(port: str, deadline_seconds: str = "400") -> int:
    deadline = time.time() + float(deadline_seconds)
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return 0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
