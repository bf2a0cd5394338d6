import subprocess
import sys


def test_scheduler_and_block_manager_never_import_torch():
    code = (
        "import sys\n"
        "import deepinfer.engine.core, deepinfer.engine.core.scheduler\n"
        "import deepinfer.engine.testing.fake_executor\n"
        "bad = [m for m in ('torch', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
