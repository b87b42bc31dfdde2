"""examples/train_sft.py end to end (the YAML beside it, with command-line overrides for a short CI run)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_sft_example_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "examples/train_sft.py"), str(ROOT / "examples/train_sft.yaml"),
                          "--max_steps", "2", "--eval_strategy", "no", "--output_dir", str(tmp_path / "out"),
                          "--log_level", "warning"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(ln.startswith("patchdsl: ") and "2/2 mlp patched" in ln and "1/1 lm_head patched" in ln
               and "2/2 q_norm patched" in ln for ln in lines), out.stdout
    last = lines[-1]
    assert last.startswith("train loss ") and "eval loss" in last and last.endswith("after 2 steps"), last
