"""A small Chrome DevTools Protocol client over the standard library (no Selenium, nothing from the
network): starts Debian's headless Chromium with --remote-debugging-port, connects a WebSocket to
its page target, and sends commands (Page.navigate, Runtime.evaluate, Input.insertText, ...)."""
import base64
import json
import os
import re
import select
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request


def chromium_path():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


class WebSocket:
    """RFC 6455 client: text frames out (masked), frames in (any size, continuations joined)."""

    def __init__(self, url, timeout=30):
        m = re.match(r"ws://([^:/]+):(\d+)(/.*)", url)
        self.sock = socket.create_connection((m.group(1), int(m.group(2))), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {m.group(3)} HTTP/1.1\r\nHost: {m.group(1)}:{m.group(2)}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise RuntimeError("websocket handshake failed: " + head.decode(errors="replace"))

    def _recv(self, n):
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("websocket closed")
            out += chunk
        return out

    def send(self, text):
        data = text.encode()
        mask = os.urandom(4)
        n = len(data)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
                                if n < 65536 else bytes([0x80 | 127]) + struct.pack(">Q", n))
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def recv(self):
        message = b""
        while True:
            b0, b1 = self._recv(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._recv(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._recv(8))[0]
            payload = self._recv(n)
            op = b0 & 0x0F
            if op == 0x9:  # ping: answer, keep reading
                continue
            message += payload
            if b0 & 0x80:
                return message.decode()

    def close(self):
        self.sock.close()


class Browser:
    """Headless Chromium with one page, driven over CDP."""

    def __init__(self, width=1100, height=900):
        exe = chromium_path()
        if not exe:
            raise RuntimeError("chromium not found (scripts/install-deps.sh installs Debian's chromium)")
        # A start that prints no DevTools line in time (it happened once in a clean-clone CI run, on a 2-core
        # machine) is retried once with a fresh profile; the error quotes chromium's last words.
        port, said = None, []
        for _attempt in range(2):
            self.profile = tempfile.mkdtemp(prefix="kestrel-chromium-")
            self.proc = subprocess.Popen(
                [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-extensions", "--disable-background-networking", "--remote-debugging-port=0",
                 f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            port, said = self._devtools_port(time.time() + 45)
            if port is not None:
                break
            self.proc.kill()
            self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)
        if port is None:
            raise RuntimeError("chromium did not open its DevTools port; its last lines: " + " | ".join(said[-8:]))
        deadline = time.time() + 30
        # Stderr is no longer read: send it nowhere so chromium never blocks on a full pipe.
        self.proc.stderr.close()
        targets = []
        while time.time() < deadline and not targets:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                targets = [t for t in json.load(r) if t.get("type") == "page"]
            time.sleep(0.05)
        self.ws = WebSocket(targets[0]["webSocketDebuggerUrl"])
        self.next_id = 0
        self.events = []
        self.call("Page.enable")
        self.call("Runtime.enable")

    def _devtools_port(self, deadline):
        """Reads chromium's stderr until its DevTools line (the port) or the deadline, without blocking past it."""
        said, buf = [], ""
        fd = self.proc.stderr.fileno()
        while time.time() < deadline:
            ready, _, _ = select.select([fd], [], [], max(0.0, min(1.0, deadline - time.time())))
            if not ready:
                if self.proc.poll() is not None:
                    return None, said + [f"(exited with {self.proc.returncode})"]
                continue
            chunk = os.read(fd, 65536).decode(errors="replace")
            if not chunk:
                return None, said + [f"(exited with {self.proc.poll()})"]
            buf += chunk
            *lines, buf = buf.split("\n")
            for line in lines:
                said.append(line)
                m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
                if m:
                    return int(m.group(1)), said
        return None, said + ["(timed out)"]

    def call(self, method, **params):
        self.next_id += 1
        my = self.next_id
        self.ws.send(json.dumps({"id": my, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == my:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def eval(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expr, timeout=30, interval=0.05):
        deadline = time.time() + timeout
        while time.time() < deadline:
            v = self.eval(expr)
            if v:
                return v
            time.sleep(interval)
        raise TimeoutError(f"timed out waiting for {expr}")

    def navigate(self, url):
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def type_text(self, selector, text):
        self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def press_enter(self):
        for kind in ("rawKeyDown", "char", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13,
                      text="\r" if kind == "char" else "")

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self):
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)
