"""Stand-ins for llama.cpp's tools, so the benchmarks' llama.cpp plumbing runs in tests without a 10-minute
build (the committed results used the real tools): llama-quantize copies its input, llama-bench prints a recorded
result, llama-server answers health, models and streamed chat completions. Each logs its arguments to calls.log."""

from __future__ import annotations

import json
import shutil
import stat
import sys
from pathlib import Path

_SERVER = r'''
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
open(LOG, "a").write(" ".join(["llama-server", *args]) + "\n")
port = int(args[args.index("--port") + 1])

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _json(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self._json({"status": "ok"} if self.path == "/health" else {"data": [{"id": "fake.gguf"}]})
    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = int(request.get("max_tokens", 4))
        if not request.get("stream"):
            return self._json({"choices": [{"message": {"content": "t" * n}, "finish_reason": "length"}]})
        self.send_response(200); self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close"); self.end_headers()
        try:
            for _ in range(n):
                time.sleep(0.005)
                self.wfile.write(b'data: {"choices": [{"delta": {"content": "t"}}]}\n\n'); self.wfile.flush()
            self.wfile.write(b'data: {"choices": [{"delta": {}, "finish_reason": "length"}]}\n\ndata: [DONE]\n\n')
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
try:
    server.serve_forever()
except KeyboardInterrupt:
    pass
'''


def fake_llama_cpp(folder: Path, recorded_bench: list[dict], crash_on_repack: bool = False) -> Path:
    """A llama.cpp "build" in folder/bin whose llama-bench prints `recorded_bench` (or, with `crash_on_repack`,
    kills itself with SIGSEGV when asked to repack, as the real one does on some CPUs); returns `folder`."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True)
    log = str(folder / "calls.log")
    scripts = {
        "llama-quantize": "import shutil, sys\nshutil.copyfile(sys.argv[-3], sys.argv[-2])\n",
        "llama-bench": (f"import json, sys\nopen({log!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
                        "if '--version' in sys.argv: print('version: 0 (test)'); sys.exit(0)\n"
                        + ("import os, signal\nif sys.argv[sys.argv.index('--repack') + 1] == '1': "
                           "os.kill(os.getpid(), signal.SIGSEGV)\n" if crash_on_repack else "")
                        + f"print(json.dumps({recorded_bench!r}))\n"),
        "llama-server": f"LOG = {log!r}\n{_SERVER}",
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


def probe_model_with_gguf(probe_model_dir: Path, dest: Path) -> Path:
    """A copy of the probe model whose manifest names a kept (placeholder) Q4_1 GGUF, as `models pull` keeps one."""
    shutil.copytree(probe_model_dir, dest)
    (dest / "probe.Q4_1.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    manifest_path = dest / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    manifest_path.write_text(json.dumps({**manifest, "gguf": {"file": "probe.Q4_1.gguf"}}))
    return dest
