"""A conversion (and eval, analyze) of a local source with no Hub text named never touches the network: the "auto"
texts are the offline mixture without a probe. The Hub endpoint is a local socket that records every connection made to it."""

import socket
import subprocess
import sys
import threading

import pytest

from hfcompress.sources.text import LOCAL_SOURCE_REASON, _probe_dataset
from tests.hub_server import subprocess_env
from tests.test_convert import FAST


class RecordingEndpoint:
    """A TCP socket on localhost that accepts, records and closes every connection (no HTTP answer)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.connections: list[tuple[str, int]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.server.accept()
            except OSError:  # closed
                return
            self.connections.append(peer)
            conn.close()


@pytest.mark.slow  # a real conversion or CLI process: the fast tier stays under 5 minutes
@pytest.mark.own_local_hub  # online: HF_HUB_OFFLINE would hide the probe this test is about
def test_a_local_source_with_auto_texts_makes_no_connection(tiny_llama_dir, tmp_path):
    endpoint = RecordingEndpoint()
    try:
        _probe_dataset(endpoint.url, "someone/recorder-check")  # the recorder sees a probe made outside a local run
        assert len(endpoint.connections) >= 1
        seen = len(endpoint.connections)
        proc = subprocess.run(
            [sys.executable, "-m", "hfcompress.cli", "convert", str(tiny_llama_dir), "--out", str(tmp_path / "out"),
             "--max-ppl-increase", "1000", "--no-speed", "--no-probe", "--ood-text", "none", *FAST],
            env={**subprocess_env(endpoint.url, tmp_path / "hf", token=None), "HFCOMPRESS_CACHE": str(tmp_path / "cache")},
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        # the other commands on local models: eval of the output beside its original, analyze of the source
        env = {**subprocess_env(endpoint.url, tmp_path / "hf", token=None), "HFCOMPRESS_CACHE": str(tmp_path / "cache")}
        for args in (["eval", str(tmp_path / "out"), "--baseline", str(tiny_llama_dir), "--no-speed", "--no-probe",
                      "--eval-tokens", "256", "--ood-text", "none"],
                     ["analyze", str(tiny_llama_dir), "--plot", str(tmp_path / "similarity.png"), "--calib-sequences", "4",
                      "--seq-len", "64"]):  # fmt: skip
            other = subprocess.run([sys.executable, "-m", "hfcompress.cli", *args], env=env, capture_output=True, text=True, timeout=600)
            assert other.returncode == 0, (args[0], other.stderr[-3000:])
    finally:
        endpoint.server.close()
    assert endpoint.connections[seen:] == []
    assert f"(auto: {LOCAL_SOURCE_REASON})" in " ".join(proc.stderr.split())
