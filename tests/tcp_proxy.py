"""A TCP relay for tests of dropped connections: its client side can be cut while its
server side stays open, so the server keeps a connection (a ghost) its client no longer has."""

from __future__ import annotations

import socket
import threading


class CuttableProxy:
    """Relays 127.0.0.1:`port` to 127.0.0.1:`target_port`, one upstream connection per client."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.ghosts: list[socket.socket] = []
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.1)
        while not self.stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.pairs.append((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    return
                dst.sendall(data)
            except OSError:
                return

    def cut_clients(self) -> None:
        """Close every client side; keep the server sides open (and silent)."""
        for client, upstream in self.pairs:
            self.ghosts.append(upstream)
            client.shutdown(socket.SHUT_RDWR)
            client.close()
        self.pairs = []

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        for s in self.ghosts + [x for p in self.pairs for x in p]:
            s.close()
