"""``transformer.client`` must import with none of the server's dependencies installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = ("fastapi", "uvicorn", "starlette", "torchvision", "httpx", "prometheus_client", "nvidia", "simplejpeg")


def test_client_imports_without_server_dependencies() -> None:
    # A meta path finder that refuses the server's packages stands in for an environment without them.
    script = textwrap.dedent(
        f"""
        import sys
        BLOCKED = {BLOCKED!r}

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"blocked: {{name}}")
                return None

        sys.meta_path.insert(0, Block())
        import transformer.client as client
        from transformer.client import (CudaPrefetcher, EpochUrls, EtlSettings, convert, make_loader, register,
                                        runtime_spec_yaml, shuffle_shards)
        settings = EtlSettings(image="registry/ais-wds-transformer:0.1.0")
        assert "ETL_PRESET" in runtime_spec_yaml("wds-etl", settings)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_blocking_finder_really_blocks() -> None:
    """The check above can fail: importing the server under the same finder does."""
    script = textwrap.dedent(
        f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {BLOCKED!r}:
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, Block())
        import transformer.server
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "ModuleNotFoundError" in result.stderr
