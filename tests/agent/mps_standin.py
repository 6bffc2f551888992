"""A stand-in for `nvidia-cuda-mps-control`, behaving as the real binary does in
shared/fixtures/gpu/mps-control.txt and mps-control.log, for the supervision tests.

    python mps_standin.py -f    the control daemon, in the foreground
    python mps_standin.py -d    the control daemon, daemonized (the parent exits 0)
    python mps_standin.py       the client: each stdin line is a command sent to the
                                daemon, its answer printed; exit 1 when no daemon answers

Like the real one it takes CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps) and
CUDA_MPS_LOG_DIRECTORY (control.log, the real log's line format), refuses to start when a
daemon already answers on the pipe directory, and answers `get_server_list` (empty until a
client would connect: the real daemon starts a server only then; STANDIN_SERVERS, e.g.
"663", for one that is up),
`get_default_active_thread_percentage` (100.0) and `quit` (exit 0). Test hooks that the real
daemon lacks: `die` (exit 3 at once, no answer), `hang` (stop answering, stay alive), and
STANDIN_START_DELAY (seconds before the control socket exists), STANDIN_EXIT_AT_START (exit
4 before serving).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from pathlib import Path

PIPE = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
LOGS = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
CONTROL = PIPE / "control"


def logline(text: str) -> None:
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    line = f"[{stamp} Control {os.getpid():>5}] {text}\n"
    LOGS.mkdir(parents=True, exist_ok=True)
    with (LOGS / "control.log").open("a") as log:
        log.write(line)
    sys.stdout.write(line)
    sys.stdout.flush()


def ask(command: str) -> str | None:
    with socket.socket(socket.AF_UNIX) as client:
        try:
            client.connect(str(CONTROL))
        except OSError:
            return None
        client.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := client.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def daemon() -> int:
    if CONTROL.exists() and ask("get_server_list") is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    if os.environ.get("STANDIN_EXIT_AT_START"):
        return 4
    time.sleep(float(os.environ.get("STANDIN_START_DELAY", "0")))
    PIPE.mkdir(parents=True, exist_ok=True)
    CONTROL.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(CONTROL))
    server.listen(8)
    logline(f"Starting control daemon using socket {CONTROL}")
    logline(f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={PIPE}")
    logline(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}")
    while True:
        connection, _ = server.accept()
        with connection:
            logline("Accepting connection...")
            command = connection.makefile().readline().strip()
            logline("NEW UI")
            logline(f"Cmd:{command}")
            if command == "die":
                os._exit(3)
            if command == "hang":
                while True:
                    time.sleep(3600)
            servers = "".join(f"{pid}\n" for pid in os.environ.get("STANDIN_SERVERS", "").split())
            answers = {
                "get_server_list": servers,
                "get_default_active_thread_percentage": "100.0\n",
            }
            if command == "quit":
                connection.sendall(b"")
                logline("Exit with status 0")
                CONTROL.unlink(missing_ok=True)
                return 0
            connection.sendall(answers.get(command, "").encode())
            logline("UI closed")


def client() -> int:
    for line in sys.stdin:
        answer = ask(line.strip())
        if answer is None:
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        sys.stdout.write(answer)
    return 0


def main() -> int:
    if sys.argv[1:] == ["-f"]:
        return daemon()
    if sys.argv[1:] == ["-d"]:
        if os.fork():
            return 0
        os.setsid()
        return daemon()
    return client()


if __name__ == "__main__":
    sys.exit(main())
