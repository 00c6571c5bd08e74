"""Starting and stopping `kestrel serve` for the end-to-end and load tests."""
import json
import re
import socket
import subprocess
import threading
import time
import urllib.request


class Server:
    def __init__(self, kestrel_bin, model_dir, *args, wait_ready=True, env=None):
        self.proc = subprocess.Popen([kestrel_bin, "serve", "--model", str(model_dir), "--port", "0", *map(str, args)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self._start(wait_ready)

    def _start(self, wait_ready=True):
        self.lines = []
        deadline = time.time() + 30
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("kestrel serve exited: " + "".join(self.lines))
            self.lines.append(line)
            m = re.search(r"listening on http://([\d.]+):(\d+)", line)
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                break
        else:
            raise RuntimeError("kestrel serve did not start")
        self.url = f"http://{self.host}:{self.port}"
        # The server logs a line per request: keep reading, so the pipe never fills and blocks it.
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        if wait_ready:
            self.wait_healthy()

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self, until=None, timeout=10):
        """What the server printed so far; with `until`, waits for that text first."""
        deadline = time.time() + timeout
        while until is not None and until not in "".join(self.lines) and time.time() < deadline:
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                break
            time.sleep(0.02)
        return "".join(self.lines)

    def log_records(self, event="access"):
        """The JSON log lines the server wrote so far (log.h), those of one event kind."""
        out = []
        for line in list(self.lines):
            line = line.strip()
            if line.startswith("{"):
                try:
                    j = json.loads(line)
                except ValueError:
                    continue
                if j.get("event") == event:
                    out.append(j)
        return out

    def health(self):
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def wait_healthy(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.health() == 200:
                return
            time.sleep(0.05)
        raise RuntimeError("kestrel serve never became healthy")

    def metrics(self):
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
        return out, text

    def raw(self, data: bytes, timeout=10):
        """Sends raw bytes; returns everything the server sends back until it closes."""
        with socket.create_connection((self.host, self.port), timeout=timeout) as s:
            try:
                s.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered (413, 400) before reading everything
            chunks = []
            while True:
                try:
                    b = s.recv(65536)
                except ConnectionResetError:
                    break
                if not b:
                    break
                chunks.append(b)
        return b"".join(chunks)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        self.proc.stdout.close()
        return self.proc.returncode
