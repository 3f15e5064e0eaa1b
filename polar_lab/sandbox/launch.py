"""The first program of an isolated sandbox whose harness has a session: it listens on the session's own
address (127.0.0.1:port) inside the sandbox's empty network namespace and forwards every connection to the
Lab's unix socket (bound into the sandbox); then it runs the program and exits as the program did.

It runs as the sandbox's user with `python -I -S`: standard library only, nothing of polar_lab imported.
The harness may kill it; then it loses its own way to the proxy and nothing else.

    python -I -S launch.py --listen 127.0.0.1 41234 --to /run/polar/proxy.sock -- argv...
"""

from __future__ import annotations

import os
import signal
import sys

TYPE_CHECKING = False  # typing's constant without importing typing: this starts before every isolated run
if TYPE_CHECKING:  # socket itself is imported where a session needs the forwarder
    import socket


def pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy bytes one way until `source` ends; then end `sink`'s writing side (HTTP keep-alive half-closes)."""
    import socket

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
    import socket
    import threading

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
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    return listener


def main(args: list[str]) -> int:
    split = args.index("--")
    options, argv = args[:split], args[split + 1:]
    listener = None
    if "--listen" in options:  # bound before the program starts, so its first call never races the forwarder
        at = options.index("--listen")
        listener = listen(options[at + 1], int(options[at + 2]))
    child = os.fork()  # fork + exec, not subprocess: this starts before every isolated harness, so it starts lean
    if child == 0:
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; the program gets the defaults
            signal.signal(sig, signal.SIG_DFL)
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            print(f"sandbox: cannot start {argv[0]}: {exc}", file=sys.stderr)
        os._exit(127)
    if listener is not None:
        import threading

        threading.Thread(target=forward, args=(listener, options[options.index("--to") + 1]), daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _frame: os.kill(child, s))
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if code < 0:  # end the same way, so the caller sees the program's signal (SIGXCPU: its CPU limit)
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught, nor given a handler
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code  # a signal whose default is not to end a process
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
