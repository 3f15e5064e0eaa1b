"""The first program of an isolated sandbox that talks to the proxy: it listens on the session's own
address (127.0.0.1:port) inside the sandbox's empty network namespace, forwards every connection to the
Lab's unix socket (bound into the sandbox), runs the harness, and exits as the harness did.

It runs as the sandbox's user with `python -I -S`: standard library only, nothing of polar_lab imported.
The harness may kill it; then it loses its own way to the proxy and nothing else.

    python -I -S launch.py --listen 127.0.0.1 41234 --to /run/polar/proxy.sock -- argv...
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading


def pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy bytes one way until `source` ends; then end `sink`'s writing side (HTTP keep-alive half-closes)."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def forward(listener: socket.socket, target: str) -> None:
    """Accept connections forever; each gets its own connection to `target` and two pumps."""
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(target)
        except OSError:
            client.close()
            upstream.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    return listener


def main(args: list[str]) -> int:
    split = args.index("--")
    options, argv = args[:split], args[split + 1:]
    host, port, target = options[options.index("--listen") + 1], int(options[options.index("--listen") + 2]), \
        options[options.index("--to") + 1]
    listener = listen(host, port)  # before the harness starts: its first call never races the forwarder
    threading.Thread(target=forward, args=(listener, target), daemon=True).start()
    try:
        child = subprocess.Popen(argv)
    except OSError as exc:
        print(f"sandbox: cannot start {argv[0]}: {exc}", file=sys.stderr)
        return 127
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _frame: child.send_signal(s))
    code = child.wait()
    if code < 0:  # end the same way, so the caller sees the harness's signal (SIGXCPU: its CPU limit)
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code  # a signal whose default is not to end a process
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
