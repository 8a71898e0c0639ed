"""Hold ``n`` idle TCP connections to ``host:port`` for ``seconds``: the attack of a local
process that opens connections to a mailbox and says nothing. Each connection the
server closes is opened again at once, so about ``n`` are held all along. A plain
process (no Ray, no secret), started by the tests:

    python -m tests.comm.idle_holder HOST PORT N SECONDS

It prints ``holding N`` once it first holds all of them, then ``reopened K`` at the end
(how many connections the server closed and it opened again).
"""

from __future__ import annotations

import selectors
import socket
import sys
import time


def _open(host: str, port: int, sel: selectors.BaseSelector) -> bool:
    try:
        sock = socket.create_connection((host, port), timeout=5)
    except OSError:
        return False
    sock.setblocking(False)
    sel.register(sock, selectors.EVENT_READ)
    return True


def main() -> None:
    host, port, n, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    sel = selectors.DefaultSelector()
    end = time.monotonic() + seconds
    held = sum(_open(host, port, sel) for _ in range(n))
    reopened = 0
    announced = False
    while time.monotonic() < end:
        if not announced and held >= n:
            print(f"holding {held}", flush=True)
            announced = True
        for key, _ in sel.select(0.2):
            sock = key.fileobj
            try:
                data = sock.recv(4096)  # the greeting, which is never answered
            except OSError:
                data = b""
            if not data:
                sel.unregister(sock)
                sock.close()
                held -= 1
        while held < n and time.monotonic() < end:
            if not _open(host, port, sel):
                break
            held += 1
            reopened += 1
    print(f"reopened {reopened}", flush=True)


if __name__ == "__main__":
    main()
