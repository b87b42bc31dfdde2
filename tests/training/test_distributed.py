"""Patched models inside FSDP2, accelerate and DeepSpeed ZeRO-3 (CPU, gloo, tiny Qwen3).

Multi-process cases run child processes (RANK/WORLD_SIZE/MASTER_* as torchrun sets them, a free
port on 127.0.0.1) and show every child's output when one fails.  docs/distributed.md says what is
covered here and what only on the GPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from patchdsl.ops import loss_path
from patchdsl.runtime.patch import PatchError, apply, unsharded_name

from ..dist_workers import SPEC

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pythonpath() -> str:
    """PYTHONPATH for a child process: this checkout first, then every directory on this process's
    ``sys.path`` (PYTHONPATH entries included, in order).  The children import what the test process
    can: on the GPU box lark & co. come from wheels that bench/gpu_all.sh installs into /tmp/site and
    puts on PYTHONPATH, which the first version of this helper replaced by the checkout alone."""
    parts = [str(REPO)]
    for p in [*os.environ.get("PYTHONPATH", "").split(os.pathsep), *sys.path]:
        if p and os.path.isdir(p) and os.path.abspath(p) not in {os.path.abspath(q) for q in parts}:
            parts.append(p)
    return os.pathsep.join(parts)


def launch(nproc: int, argv: list[str], out: Path) -> dict:
    """Run ``python argv`` as ``nproc`` ranks; return the JSON rank 0 wrote to ``out``."""
    port = free_port()
    # gloo listens on the interface its host name resolves to unless told: keep it on the loopback
    loopback = next((n for _, n in socket.if_nameindex() if n in ("lo", "lo0")), None)
    procs = []
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=child_pythonpath(), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        if loopback:
            env["GLOO_SOCKET_IFNAME"] = loopback
        procs.append(subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs, failed = [], False
    for p in procs:
        try:
            o, _ = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            o, _ = p.communicate()
            o += f"\n[killed after {TIMEOUT} s]"
        outs.append(o)
        failed |= p.returncode != 0
    if failed or not out.is_file():
        shown = "\n".join(f"----- rank {r} (exit {p.returncode}) -----\n{o[-6000:]}"
                          for r, (p, o) in enumerate(zip(procs, outs)))
        pytest.fail(f"{' '.join(argv)} failed:\n{shown}", pytrace=False)
    return json.loads(out.read_text())


def test_children_import_what_the_parent_imports(tmp_path, monkeypatch):
    """A module found only through a directory the test process added to sys.path (as
    gpu_all.sh's /tmp/site on PYTHONPATH) imports in the ranks' children too."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "patchdsl_probe_only_here.py").write_text("VALUE = 17\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", "")
    code = "import patchdsl_probe_only_here as m, patchdsl; print(m.VALUE, patchdsl.__file__)"
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    value, where = r.stdout.split()
    assert value == "17" and Path(where).resolve().is_relative_to(REPO)      # this checkout's patchdsl first


def close(a: list[float], b: list[float], rel: float = 1e-5) -> bool:
    """fp32 losses, patched vs unpatched: within verify's fp32 floor (1e-5 relative)."""
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def compile_probe() -> str | None:
    """None when torch.compile(backend="aot_eager") runs a patched tiny model here (one process, no
    FSDP); else the error, shortened: the reason to skip the compile-on-top variant."""
    from ..dist_workers import patch, tiny

    m = tiny()
    patch(m)
    m.train()
    ids = torch.randint(0, m.config.vocab_size, (1, 8))
    try:
        torch.compile(m, backend="aot_eager")(input_ids=ids, labels=ids).loss.backward()
    except Exception as e:  # noqa: BLE001 - any failure means compile of a patched model is unsupported here
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    finally:
        torch._dynamo.reset()
    return None


# ---------------------------------------------------------------- FSDP2, two processes
@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """One two-process run for the eager and the compiled checks below: per-layer + root
    fully_shard, tied embeddings, AdamW fp32, 5 steps; unpatched, patch-then-shard, shard-then-patch
    and patch-shard-compile, with the lm_head weight shape the fused loss received recorded."""
    out = tmp_path_factory.mktemp("fsdp2") / "fsdp2.json"
    return launch(2, ["-m", "patchdsl_tools.bench.fsdp2", "--tiny", "--device", "cpu", "--dtype", "fp32", "--steps", "5",
                      "--batch", "1", "--seq", "8", "--spec", SPEC, "--record-head", "--out", str(out),
                      "--variants", "unpatched,patched,shard-then-patch,patched+compile"], out)


def test_fsdp2_two_processes_patched_trains_like_unpatched(fsdp2_run):
    """Patch-then-shard and shard-then-patch give the unpatched losses; the fused loss receives the
    whole (vocab, hidden) head weight, not a shard (vocab/2 rows); undo on the sharded model works."""
    v = fsdp2_run["variants"]
    base = v["unpatched"]["losses"]
    assert len(base) == 5 and all(x == x for x in base)
    for name in ("patched", "shard-then-patch"):
        r = v[name]
        assert r["patched_sites"] == 8 and r["refused"] == [], r
        assert close(r["losses"], base), (name, r["losses"], base)
        assert r["head_weight_shapes"] == [[512, 64]] * 5, r["head_weight_shapes"]
        assert r["undo_leaves_patched_forwards"] == 0 and r["loss_after_undo_finite"]


def test_fsdp2_with_torch_compile_on_top(fsdp2_run):
    """Patch, shard, then torch.compile(backend="aot_eager"): the unpatched losses."""
    c = fsdp2_run["variants"]["patched+compile"]
    if "error" in c:
        why = compile_probe()
        where = "works alone but not under FSDP2" if why is None else f"fails even without FSDP2 ({why})"
        pytest.fail(f"torch.compile of the patched model {where}:\n{c['traceback']}")
    assert c["compile_backend"] == "aot_eager"
    assert close(c["losses"], fsdp2_run["variants"]["unpatched"]["losses"])


def test_fsdp2_lm_head_as_its_own_unit_with_the_bench_script(tmp_path):
    """bench/fsdp2_two_gpu.py (issue 17's script) at tiny size, the shipped qwen3 spec, with lm_head
    its own FSDP2 unit: its weight is gathered only inside lm_head's call, where the fused loss runs."""
    out = tmp_path / "bench.json"
    doc = launch(2, ["bench/fsdp2_two_gpu.py", "--tiny", "--device", "cpu", "--dtype", "fp32", "--steps", "2",
                     "--batch", "1", "--seq", "8", "--head-unit", "--record-head", "--out", str(out),
                     "--variants", "unpatched,patched"], out)
    assert doc["passed"] and doc["world_size"] == 2
    v = doc["variants"]
    assert v["patched"]["patched_sites"] > 8 and v["patched"]["refused"] == []
    assert v["patched"]["head_weight_shapes"] == [[512, 64]] * 2
    assert close(v["patched"]["losses"], v["unpatched"]["losses"])
    assert [r["ok"] for r in doc["judged"]] == [True, True]
    assert all(k in v["patched"] for k in ("tokens_per_s", "peak_gib_per_rank", "step_ms"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp2_bench_script_on_gpus(tmp_path):
    """The CUDA path of issue 17's script (NCCL, bf16 mixed precision, float64 reference with
    checkpointing, inductor) on a tiny Qwen3, on up to two GPUs."""
    out = tmp_path / "gpu.json"
    n = min(2, torch.cuda.device_count())
    doc = launch(n, ["bench/fsdp2_two_gpu.py", "--tiny", "--steps", "3", "--batch", "2", "--seq", "64", "--out", str(out)],
                 out)
    assert doc["device"] == "cuda" and doc["world_size"] == n
    v = doc["variants"]
    assert v["ref64"]["gradient_checkpointing"] and v["patched"]["refused"] == []
    assert all(r["ok"] for r in doc["judged"] if r["variant"] == "patched"), doc["judged"]
    assert all(p is not None and p > 0 for p in v["patched"]["peak_gib_per_rank"])


# ---------------------------------------------------------------- accelerate
def test_accelerate_prepare_plain_with_accumulation_and_fsdp2_plugin(tmp_path):
    out = tmp_path / "acc.json"
    doc = launch(2, ["-m", "tests.dist_workers", "accelerate", str(out)], out)
    ddp, fsdp = doc["ddp"], doc["fsdp2"]
    assert ddp["patched"]["wrapper"] == "DistributedDataParallel"
    assert ddp["patched"]["patched"] == 8 and len(ddp["patched"]["losses"]) == 4
    assert close(ddp["patched"]["losses"], ddp["unpatched"]["losses"])
    # accelerate itself keeps FSDP off on the CPU (the worker forces it to run its FSDP2 code)
    assert fsdp["patched"]["native_distributed_type"] == "DistributedType.MULTI_CPU"
    assert "FSDPQwen3ForCausalLM" in fsdp["patched"]["fsdp_units"]
    assert fsdp["patched"]["fsdp_units"].count("FSDPQwen3DecoderLayer") == 2
    assert close(fsdp["patched"]["losses"], fsdp["unpatched"]["losses"])
    assert fsdp["patched"]["head_weight_shapes"] == [fsdp["patched"]["vocab_hidden"]] * 3


# ---------------------------------------------------------------- DeepSpeed ZeRO-3
def test_deepspeed_zero3_one_cpu_process(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "ds.json"
    doc = launch(1, ["-m", "tests.dist_workers", "deepspeed", str(out)], out)
    p, u = doc["patched"], doc["unpatched"]
    assert p["partition_at_rest"][0] == [0] and p["partition_at_rest"][1] == [512, 64]   # really partitioned
    assert p["head_weight_shapes"] == [[512, 64]] * 3                                     # gathered when used
    assert close(p["losses"], u["losses"]), (p["losses"], u["losses"])


# ---------------------------------------------------------------- the gather logic, simulated
class FakeZero3:
    """What DeepSpeed ZeRO-3 does to a module's weight, in one process: at rest the parameter holds
    an empty partition and carries ``ds_shape``/``ds_status``; a forward pre-hook gathers it, a forward
    hook releases it, and a hook on the output gathers it again for the backward."""

    def __init__(self, module: torch.nn.Module, gather: bool = True):
        self.w = module.weight
        self.full = self.w.data
        self.w.ds_shape = self.full.shape
        self.w.ds_status = "NOT_AVAILABLE"
        self.calls = 0
        self.release()
        if gather:
            module.register_forward_pre_hook(lambda m, a: self.gather())
            module.register_forward_hook(self._post)

    def gather(self):
        self.calls += 1
        self.w.data = self.full
        self.w.ds_status = "AVAILABLE"

    def release(self):
        self.w.data = torch.empty(0, dtype=self.full.dtype)
        self.w.ds_status = "NOT_AVAILABLE"

    def _post(self, m, a, out):
        self.release()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: (self.gather(), g)[1])


def _untied_pair():
    from ..families import tiny_model

    return tiny_model("llama", seed=3), tiny_model("llama", seed=3)


def _lce(model):
    return apply("lm_head: Linear -> fused_linear_cross_entropy", model, strict=True)


def test_zero3_partition_is_gathered_through_lm_heads_own_call():
    ref, pat = _untied_pair()
    assert pat.lm_head.weight is not pat.get_input_embeddings().weight
    _lce(pat)
    fake = FakeZero3(pat.lm_head)
    assert loss_path.head_gather(pat.lm_head) == "zero3"
    ids = torch.randint(0, 320, (2, 7), generator=torch.Generator().manual_seed(5))
    lr, lp = ref(input_ids=ids, labels=ids).loss, pat(input_ids=ids, labels=ids).loss
    assert pat.lm_head.weight.shape == (0,)                # released again after the forward
    lr.backward()
    lp.backward()
    assert fake.calls == 2                                 # gathered for the forward and for the backward
    torch.testing.assert_close(lp, lr, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pat.lm_head.weight.grad, ref.lm_head.weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(pat.model.norm.weight.grad, ref.model.norm.weight.grad, rtol=1e-4, atol=1e-6)


def test_zero3_partition_that_nothing_gathers_is_a_clear_error():
    _, pat = _untied_pair()
    _lce(pat)
    FakeZero3(pat.lm_head, gather=False)
    ids = torch.randint(0, 320, (1, 5))
    with pytest.raises(RuntimeError, match=r"ZeRO-3 partition of shape \(0,\) \(whole: \(320, 64\)\)"):
        pat(input_ids=ids, labels=ids)


@pytest.mark.parametrize("make, expected", [
    (lambda: torch.nn.Linear(4, 3), None),
    (lambda: type("FSDPLinear", (type("FSDPModule", (), {}), torch.nn.Linear), {})(4, 3), "fsdp2"),
])
def test_head_gather_table(make, expected):
    assert loss_path.head_gather(make()) == expected


def test_head_gather_sees_ds_attributes():
    lin = torch.nn.Linear(4, 3)
    FakeZero3(lin, gather=False)
    assert loss_path.head_gather(lin) == "zero3"


def test_call_as_forward_runs_hooks_and_restores_the_forward():
    lin = torch.nn.Linear(4, 3)
    seen = []
    lin.register_forward_pre_hook(lambda m, a: seen.append("pre"))
    lin.register_forward_hook(lambda m, a, o: seen.append("post"))
    assert loss_path.call_as_forward(lin, lambda x: x * 2, torch.ones(2)).tolist() == [2.0, 2.0]
    assert seen == ["pre", "post"] and "forward" not in lin.__dict__
    own = types.MethodType(lambda self, x: x + 1, lin)
    lin.forward = own
    loss_path.call_as_forward(lin, lambda x: x, torch.ones(2))
    assert lin.__dict__["forward"] is own
    with pytest.raises(ValueError):
        loss_path.call_as_forward(lin, lambda x: (_ for _ in ()).throw(ValueError("boom")), torch.ones(2))
    assert lin.__dict__["forward"] is own


# ---------------------------------------------------------------- plans across fully_shard's class swap
@pytest.mark.parametrize("name, expected", [
    ("FSDPQwen3ForCausalLM", "Qwen3ForCausalLM"), ("Qwen3ForCausalLM", "Qwen3ForCausalLM"),
    ("FSDP", "FSDP"), ("FSDPmodel", "FSDPmodel"),
])
def test_unsharded_name(name, expected):
    assert unsharded_name(name) == expected


def test_plan_made_before_sharding_applies_after_the_class_swap():
    """fully_shard swaps the class for FSDP<Name>; a plan of the unsharded model still fits, another model's does not."""
    import patchdsl

    from ..families import tiny_model

    m = tiny_model("qwen3")
    plan = patchdsl.plan("model.norm: RMSNorm -> fused_rmsnorm", m)
    cls = type(m)
    m.__class__ = type("FSDP" + cls.__name__, (type("FSDPModule", (), {}), cls), {})
    with apply(plan, m) as h:
        assert h.patched == ["model.norm"]
    other = tiny_model("llama")
    other.__class__ = type("FSDP" + type(other).__name__, (type(other),), {})
    with pytest.raises(PatchError, match="made for Qwen3ForCausalLM, not FSDPLlamaForCausalLM"):
        apply(plan, other)


def test_apply_refuses_a_model_already_partitioned_by_zero3():
    from ..families import tiny_model

    m = tiny_model("llama")
    FakeZero3(m.lm_head, gather=False)
    with pytest.raises(PatchError, match=r"DeepSpeed ZeRO-3 partitions \(e.g. lm_head.weight\): patch before"):
        apply("model.norm: RMSNorm -> fused_rmsnorm", m)
    assert "forward" not in m.model.norm.__dict__


def test_qk_norm_rope_refuses_a_partitioned_q_norm_instead_of_launching_on_it():
    """q_norm/k_norm are read in the attention's forward; a ZeRO-3 partition there is an error, not a kernel launch."""
    from ..families import tiny_model

    m = tiny_model("qwen3")
    apply("model.layers.0.self_attn: Attention -> fused_qk_norm_rope", m, strict=True)
    FakeZero3(m.model.layers[0].self_attn.q_norm, gather=False)
    ids = torch.randint(0, 320, (1, 4))
    with pytest.raises(RuntimeError, match=r"q_norm.weight is a DeepSpeed ZeRO-3 partition .*persistence_threshold"):
        m(input_ids=ids)


def test_add_rmsnorm_refuses_a_partitioned_post_attention_norm():
    from ..families import tiny_model

    m = tiny_model("qwen3")
    apply("model.layers.0: DecoderLayer -> fused_add_rmsnorm", m, strict=True)
    FakeZero3(m.model.layers[0].post_attention_layernorm, gather=False)
    ids = torch.randint(0, 320, (1, 4))
    with pytest.raises(RuntimeError, match=r"post_attention_layernorm.weight is a DeepSpeed ZeRO-3 partition"):
        m(input_ids=ids)
