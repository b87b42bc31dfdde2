"""Shrinking a model's configuration to a tiny one when its sizes go by other names or it is a
composite of towers (vision-language), and :func:`tiny_config`, any family's config shrunk: used by
``load_model(..., tiny=True)`` and by the coverage census (:mod:`patchdsl_tools.census`)."""

from __future__ import annotations

import re

from .config_names import attribute_map, with_real_names, with_standard_names

def shrink_composite(cfg, tiny_config):
    """A composite (vision-language) config shrunk: the language tower by ``tiny_config`` (as any
    family), the other towers generically (:func:`_tiny_tower`), multimodal RoPE sections with the
    head size (:func:`_fit_mrope`).  A copy; ``cfg`` is left as it is."""
    import copy

    cfg = copy.deepcopy(cfg)
    sub = {k: getattr(cfg, k) for k in ("text_config", "vision_config", "audio_config")
           if getattr(cfg, k, None) is not None and hasattr(getattr(cfg, k), "to_dict")}
    cfg.text_config = shrink_config(sub["text_config"], tiny_config)
    for k, c in sub.items():
        if k != "text_config":
            setattr(cfg, k, _tiny_tower(c, cfg.text_config, getattr(sub["text_config"], "hidden_size", None)))
    _fit_mrope(cfg.text_config)
    if isinstance(getattr(cfg, "mm_tokens_per_image", None), int):
        # Gemma 3: image tokens = (image_size / patch_size)^2 pooled to this many
        side = getattr(cfg.vision_config, "image_size", 32) // getattr(cfg.vision_config, "patch_size", 8)
        cfg.mm_tokens_per_image = min(cfg.mm_tokens_per_image, side * side)
    return cfg


def _fit_mrope(text) -> None:
    """Multimodal RoPE (Qwen2/2.5/3-VL): the rotary splits head_dim / 2 into temporal, height and
    width sections (``rope_parameters["mrope_section"]``, else a default in the modeling code sized
    for the full head_dim); shrunk with head_dim, in the same proportions, summing to head_dim / 2."""
    import importlib

    rope = getattr(text, "rope_parameters", None)
    if not isinstance(rope, dict):
        return
    sec = rope.get("mrope_section")
    if sec is None:
        try:
            src = importlib.import_module(type(text).__module__.replace("configuration_", "modeling_"))
            import inspect
            m = re.search(r'mrope_section",\s*\[(\d+),\s*(\d+),\s*(\d+)\]', inspect.getsource(src))
        except Exception:
            m = None
        if m is None:
            return
        sec = [int(x) for x in m.groups()]
    hd = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    half = int(hd * (rope.get("partial_rotary_factor") or 1.0)) // 2
    if sum(sec) == half:
        return
    new = [max(1, round(x * half / sum(sec))) for x in sec]
    new[0] += half - sum(new)
    rope["mrope_section"] = new
    text.rope_parameters = rope


def shrink_config(cfg, tiny_config):
    """``tiny_config(cfg)``: kept for its callers; :func:`tiny_config` reads a family's own size names
    (GPT-2's ``n_embd``) through the config class's ``attribute_map`` itself."""
    return tiny_config(cfg)


_TOWER_SIZES = (("hidden_size", 64), ("embed_dim", 64), ("intermediate_size", 128), ("num_hidden_layers", 1), ("depth", 1),
                ("num_layers", 1), ("num_attention_heads", 2), ("num_heads", 2), ("num_key_value_heads", 2),
                ("image_size", 32), ("patch_size", 8), ("num_global_layers", 1))


def _tiny_tower(c, text, text_hidden0=None):
    """A vision/audio tower shrunk by its common size names (sizes it does not have are left; a tower's
    own names for them through its ``attribute_map``).  A tower whose own width is ``embed_dim`` and whose
    ``hidden_size`` is the language model's (Qwen2-VL: its merger projects to the text width) gets the
    shrunk text width there (``text_hidden0``: the text tower's width before shrinking)."""
    d, added = with_standard_names(c.to_dict(), attribute_map(c))
    layers0 = {k: d[k] for k in ("num_hidden_layers", "depth", "num_layers") if isinstance(d.get(k), int)}
    for k, v in _TOWER_SIZES:
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool) and d[k] > v:
            d[k] = v
    for k, n0 in layers0.items():
        # per-layer lists of the tower (MuSE-Glimmer's layer_types) follow its layer count
        for key, v in list(d.items()):
            if (key not in _NOT_PER_LAYER and isinstance(v, list) and len(v) == n0 > d[k]
                    and all(not isinstance(x, (list, dict)) for x in v)):
                d[key] = v[:d[k]]
    for k in ("out_hidden_size", "projection_dim", "text_hidden_size"):
        if isinstance(d.get(k), int):
            d[k] = text.hidden_size
    if isinstance(d.get("embed_dim"), int) and text_hidden0 is not None and c.to_dict().get(
            added.get("hidden_size", "hidden_size")) == text_hidden0:
        d["hidden_size"] = text.hidden_size      # Qwen2-VL: the vision merger's output is the text width
    for k in ("intermediate_layers_indices", "deepstack_visual_indexes", "fullatt_block_indexes"):
        if isinstance(d.get(k), list):
            d[k] = [0]
    d.pop("head_dim", None) if isinstance(d.get("head_dim"), int) else None
    return type(c).from_dict(with_real_names(d, added))


# ---- tiny_config: any family's config shrunk for CPU tests and demos (was in loading.py) -------------
# keys of a config that are not per-layer lists even when they are lists
_NOT_PER_LAYER = {"architectures", "bos_token_id", "eos_token_id", "pad_token_id", "mlp_only_layers"}


def _round_to(x: float, m: int, lo: int) -> int:
    return max(lo, int(round(x / m)) * m)


def _resample(values: list, n: int) -> list:
    if len(values) == n or not values:
        return list(values)
    return [values[min(len(values) - 1, int(i * len(values) / n))] for i in range(n)]


def tiny_config(config, *, layers: int = 2, vocab: int = 512):
    """A shrunk copy of ``config`` for CPU tests and demos.

    Keeps the family (same config class and model class) and every structural feature: GQA/MQA/MHA,
    head_dim decoupled from hidden/heads (Qwen3, Gemma3) or not, q/k norms, partial rotary, rope
    scaling type, tied embeddings, softcapping, the mix of sliding and full attention layers (a
    sliding window of 8 so that short sequences exercise it), MLP/hidden ratio. Sizes become
    hidden 64-160, head_dim 16 or 32, ``layers`` layers (more when the layer pattern has more kinds)
    and a ``vocab`` vocabulary; special token ids beyond it are moved inside it.  A config already
    smaller keeps its own layer count and vocabulary (tiny never grows a user's model).
    """
    if getattr(config, "text_config", None) is not None and hasattr(config.text_config, "to_dict"):
        # a vision-language model: its language tower shrunk as above, the vision tower by its common
        # size names, multimodal RoPE sections with the head size (patchdsl.model.shrink)
        return shrink_composite(config, lambda c: tiny_config(c, layers=layers, vocab=vocab))
    # the sizes by their standard names, whatever the family calls them (GPT-2: n_embd, n_head, n_layer)
    d, added = with_standard_names(config.to_dict(), attribute_map(config))
    H0 = int(d["num_attention_heads"])
    KV0 = int(d.get("num_key_value_heads") or H0)
    hidden0 = int(d["hidden_size"])
    L0 = int(d["num_hidden_layers"])
    hd0 = d.get("head_dim") or hidden0 // H0
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    prf = d.get("partial_rotary_factor") or (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None)

    # heads: keep MHA / MQA / GQA (and a group ratio up to 4)
    if KV0 >= H0:
        H, KV = 4, 4
    elif KV0 == 1:
        H, KV = min(H0, 4), 1
    else:
        KV = 2
        H = 2 * max(2, min(H0 // KV0, 4))
    # head_dim: coupled (hidden == heads * head_dim) or decoupled, as in the original
    decoupled = hd0 * H0 != hidden0
    hd = 32 if decoupled else 16
    if prf:
        hd = next((c for c in (hd, 32, 64) if abs(c * prf - round(c * prf)) < 1e-9 and round(c * prf) % 2 == 0), hd)
    q = H * hd
    if not decoupled:
        hidden = q
    elif hd0 * H0 > hidden0:
        hidden = q // 2        # e.g. Qwen3: q projection wider than the residual stream
    else:
        hidden = q + 32        # e.g. Gemma3: narrower
    d.update(num_attention_heads=H, num_key_value_heads=KV, hidden_size=hidden)
    if d.get("head_dim") is not None or decoupled:
        d["head_dim"] = hd
    if d.get("query_pre_attn_scalar"):
        qs = d["query_pre_attn_scalar"] * hd / hd0
        d["query_pre_attn_scalar"] = round(qs) if isinstance(d["query_pre_attn_scalar"], int) else qs
    for k in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if isinstance(d.get(k), int) and d[k] > 0:
            d[k] = _round_to(d[k] * hidden / hidden0, 16, 16)

    # layers: keep one of each layer kind (sliding/full/...), in order of first appearance
    types = d.get("layer_types")
    idx = sorted(types.index(t) for t in dict.fromkeys(types)) if isinstance(types, list) and len(types) == L0 else []
    n = max(min(layers, L0), len(idx), 1)
    nxt = 0
    while len(idx) < n:
        if nxt not in idx:
            idx.append(nxt)
        nxt += 1
    idx.sort()
    for k, v in list(d.items()):         # per-layer lists (layer_types, no_rope_layers, ...)
        if k in _NOT_PER_LAYER:
            continue
        if isinstance(v, list) and len(v) == L0 and L0 > 1 and all(not isinstance(x, (list, dict)) for x in v):
            d[k] = [v[min(i, L0 - 1)] for i in idx]
    _per_layer_overrides(d, idx, L0, hd / hd0)
    d["num_hidden_layers"] = n
    if isinstance(d.get("max_window_layers"), int):
        d["max_window_layers"] = min(n, round(d["max_window_layers"] * n / L0))
    if d.get("sliding_window"):
        d["sliding_window"] = min(int(d["sliding_window"]), 8)
    rates = d.get("compress_rates")
    if isinstance(rates, dict) and all(isinstance(v, int) and not isinstance(v, bool) for v in rates.values()):
        # DeepSeek-V4's compressed attention (a token per 4, per 128): a few compressed tokens at 8-token
        # workloads, not none (an empty tensor through the compressor's norm)
        d["compress_rates"] = {k: min(v, 2 if v == min(rates.values()) else 4) for k, v in rates.items()}
    _tiny_mamba(d, hidden, hidden0)
    _tiny_moe_defaults(d)
    grouped = _tiny_groups(d)
    for k in ("num_experts", "num_local_experts", "n_routed_experts"):
        if isinstance(d.get(k), int) and d[k] > 4 and not grouped:
            d[k] = 4
    if isinstance(d.get("num_experts_per_tok"), int):
        d["num_experts_per_tok"] = min(d["num_experts_per_tok"], 2)
    if isinstance(d.get("first_k_dense_replace"), int) and d["first_k_dense_replace"] >= n:
        # DeepSeek-V2/V3, dots1: the first k layers dense, the rest MoE; keep one of each (as layer kinds)
        d["first_k_dense_replace"] = n - 1
    _tiny_mla(d)

    # rope: long-rope factor lists follow the rotary dimension
    rot_half = int(hd * (prf or 1.0)) // 2

    def fix_rope(r):
        if isinstance(r, dict):
            for k in ("short_factor", "long_factor"):
                if isinstance(r.get(k), list):
                    r[k] = _resample(r[k], rot_half)
            for v in r.values():
                if isinstance(v, dict):
                    fix_rope(v)
    for k in ("rope_parameters", "rope_scaling"):
        fix_rope(d.get(k))

    # vocabulary and the special ids in it
    vocab = min(vocab, int(d.get("vocab_size") or vocab))
    d["vocab_size"] = vocab
    # Gemma 3n / 4's per-layer input embeddings (a vocab x layers x width table: 262144 x 30 x 256 by default)
    if isinstance(d.get("vocab_size_per_layer_input"), int) and d["vocab_size_per_layer_input"] > vocab:
        d["vocab_size_per_layer_input"] = vocab
    if isinstance(d.get("hidden_size_per_layer_input"), int) and d["hidden_size_per_layer_input"] > 16:
        d["hidden_size_per_layer_input"] = 16
    big = sorted({i for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  for i in (d.get(k) if isinstance(d.get(k), list) else [d.get(k)])
                  if isinstance(i, int) and i >= vocab})
    remap = {old: vocab - 1 - j for j, old in enumerate(big)}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = d.get(k)
        if isinstance(v, list):
            d[k] = [remap.get(i, i) for i in v]
        elif isinstance(v, int):
            d[k] = remap.get(v, v)
    d.pop("transformers_version", None)
    new = type(config).from_dict(with_real_names(d, added))
    new._name_or_path = f"tiny:{getattr(config, '_name_or_path', '') or d.get('model_type')}"
    return new


def _per_layer_overrides(d: dict, idx: list, L0: int, head_scale: float) -> None:
    """Per-layer overrides keyed by layer index (Gemma 4's ``per_layer_config``: ``{"05": {"head_dim": 512}}``,
    its full-attention layers' wider heads) for the kept layers ``idx``, renumbered, their head sizes shrunk
    with the others' (transformers checks the keys against ``num_hidden_layers``)."""
    for k, v in list(d.items()):
        if not (isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values())):
            continue
        try:
            old = {int(x): x for x in v}
        except (TypeError, ValueError):
            continue
        if not all(0 <= i < L0 for i in old):
            continue
        width = max(len(str(x)) for x in v) if all(isinstance(x, str) for x in v) else 0
        new = {}
        for pos, i in enumerate(idx):
            if i in old:
                o = dict(v[old[i]])
                if isinstance(o.get("head_dim"), int):
                    o["head_dim"] = max(2, int(round(o["head_dim"] * head_scale / 2)) * 2)
                new[str(pos).zfill(width) if width else pos] = o
        d[k] = new


# MoE sizes a family's default config leaves None though its modelling code needs them (transformers 5.x):
# the released checkpoint's values (then shrunk as every MoE config is).  DeepSeek-V2 / V2-Lite route 6
# experts per token; dots.llm1 has 128 routed experts, 6 per token, 2 shared, the first layer dense.
_MOE_DEFAULTS = {
    "deepseek_v2": {"num_experts_per_tok": 6},
    "dots1": {"n_routed_experts": 128, "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1},
}


def _tiny_moe_defaults(d: dict) -> None:
    fills = _MOE_DEFAULTS.get(d.get("model_type"), {})
    no_experts = all(d.get(k) is None for k in ("n_routed_experts", "num_local_experts", "num_experts"))
    for k, v in fills.items():
        if d.get(k) is None or (k == "first_k_dense_replace" and no_experts):
            d[k] = v
            if k == "n_routed_experts":          # its standard names too (tiny_config reads attribute_map's)
                for alias in ("num_local_experts", "num_experts"):
                    if alias in d and d[alias] is None:
                        d[alias] = v


def _tiny_groups(d: dict) -> bool:
    """A grouped router (DeepSeek-V2's group-limited greedy, DeepSeek-V3 / GLM-4.5's grouped top-k:
    ``n_group`` > 1) shrunk with its groups: 8 experts in at most 4 groups of 2 (the top-2 group score
    needs 2 per group), as many groups kept in proportion (at least 1, fewer than all when the original
    drops some), top-k within the kept experts.  True when it did."""
    E = next((d[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if isinstance(d.get(k), int)), None)
    ng, tg = d.get("n_group"), d.get("topk_group")
    if not (isinstance(E, int) and isinstance(ng, int) and isinstance(tg, int) and ng > 1 and E % ng == 0):
        return False
    ng2 = min(ng, 4)
    tg2 = ng2 if tg >= ng else max(1, min(ng2 - 1, round(tg * ng2 / ng)))
    E2 = 2 * ng2
    for k in ("n_routed_experts", "num_experts", "num_local_experts"):
        if isinstance(d.get(k), int):
            d[k] = E2
    d.update(n_group=ng2, topk_group=tg2)
    if isinstance(d.get("num_experts_per_tok"), int):
        d["num_experts_per_tok"] = min(d["num_experts_per_tok"], 2, tg2 * (E2 // ng2))
    return True


def _tiny_mla(d: dict) -> None:
    """Multi-head latent attention (DeepSeek-V2/V3: ``kv_lora_rank``, ``qk_rope_head_dim``): its ranks and
    head sizes shrunk together, the rotary head size its ``head_dim`` (transformers sets it so)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if (not isinstance(d.get("kv_lora_rank"), int) or not isinstance(d.get("qk_rope_head_dim"), int)
            or d["qk_rope_head_dim"] <= 0 or (isinstance(rope, dict) and rope.get("mrope_section"))):
        return       # no MLA, a NoPE one (GLM-5's DSA), or multimodal RoPE sections sized by the shrink elsewhere
    prf = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    hd = round(16 / prf) if isinstance(prf, (int, float)) and 0 < prf < 1 else 16     # Mistral 4: head_dim x prf rotates
    d.update(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, head_dim=hd)
    if isinstance(d.get("q_lora_rank"), int):
        d["q_lora_rank"] = 48


def _tiny_mamba(d: dict, hidden: int, hidden0: int) -> None:
    """The Mamba-2 mixer of a hybrid family (Bamba, Falcon-H1, GraniteMoeHybrid: ``mamba_n_heads``,
    ``mamba_d_head``, ``mamba_d_state``, ``mamba_chunk_size``, Falcon-H1's ``mamba_d_ssm``) shrunk as the
    attention is: its default sizes stay otherwise (128 heads, a 256-wide state, chunks of 256), and
    transformers' reference scan (no ``mamba_ssm`` on a CPU) holds batch x chunk^2 x heads x state
    values, 17 GB at batch 2 in transformers 5.17.  Keeps the families' own checks: heads divide the
    mixer width (``mamba_d_ssm`` or expand x hidden) into ``mamba_d_head``, groups divide heads."""
    if not (isinstance(d.get("mamba_n_heads"), int) and isinstance(d.get("mamba_d_state"), int)):
        return
    if isinstance(d.get("mamba_d_ssm"), int):
        d["mamba_d_ssm"] = _round_to(d["mamba_d_ssm"] * hidden / hidden0, 16, 16)
        width = d["mamba_d_ssm"]
    else:
        width = int(d.get("mamba_expand") or 2) * hidden
    groups = min(int(d.get("mamba_n_groups") or 1), 2)
    heads = next(h for h in (8, 4, 2, 1) if width % h == 0 and h % groups == 0)
    d.update(mamba_n_heads=heads, mamba_d_head=width // heads, mamba_n_groups=groups,
             mamba_d_state=min(d["mamba_d_state"], 16))
    if isinstance(d.get("mamba_chunk_size"), int):
        d["mamba_chunk_size"] = min(d["mamba_chunk_size"], 16)


def _describe_tiny(cfg) -> str:
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg     # a VLM: its language tower
    return (f"tiny {cfg.model_type} (hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
            f"{cfg.num_attention_heads}/{getattr(cfg, 'num_key_value_heads', None) or cfg.num_attention_heads} heads, "
            f"vocab {cfg.vocab_size})")


_SIZES = (("hidden_size", "hidden {}"), ("num_hidden_layers", "{} layers"), ("num_attention_heads", "{} heads"),
          ("intermediate_size", "intermediate {}"), ("vocab_size", "vocab {}"))


def describe_shrink(full, tiny) -> str:
    """What shrinking ``full`` to ``tiny`` changed, in the sizes a reader knows (language tower of a VLM):
    ``shrunk from hidden 1024, 28 layers``, naming only the sizes that did change, or ``already tiny (its
    own sizes)`` when none did -- never "shrunk from hidden 64" to hidden 64."""
    f = full.get_text_config() if hasattr(full, "get_text_config") else full
    t = tiny.get_text_config() if hasattr(tiny, "get_text_config") else tiny
    changed = [fmt.format(getattr(f, k, None)) for k, fmt in _SIZES
               if getattr(f, k, None) is not None and getattr(f, k, None) != getattr(t, k, None)]
    return f"shrunk from {', '.join(changed)}" if changed else "already tiny (its own sizes)"


# ---------------------------------------------------------------- loading
