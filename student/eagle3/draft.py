"""The EAGLE-3 draft recipe: train a speculative-decoding draft from the teacher's stream, export it
in vLLM's native EAGLE-3 layout.

Selected by `student.recipe: eagle3` (the `student.eagle3` section, student/config.py). The loop
is student/train.py's; this module gives it three things:

- `build_draft(cfg)`: the draft (`Eagle3Draft`, the trained module), the frozen teacher parts
  (`TeacherParts`: embeddings, final norm, LM head; kept outside the draft so DDP and checkpoints
  never carry them) and the teacher layer ids every batch must carry.
- `draft_loss(model, frozen, batch, cfg)`: the loss of one micro-batch and its named terms.
- `export_draft(model, folder)`: a folder vLLM loads as
  `speculative_config={"method": "eagle3", "model": folder, "num_speculative_tokens": k}`.

The draft (vLLM's Llama EAGLE-3 "midlayer", llama_eagle3.py):

    fused  = fc(cat(aux_a, aux_b, aux_c))                  3 teacher states (ids a < b < c) -> H
    x      = cat(input_layernorm(embed(token)), hidden_norm(fused))          [2H]
    h      = residual + o_proj(attention(x))                 residual: fused (or hidden_norm(fused)
    h      = h + mlp(post_attention_layernorm(h))              with norm_before_residual)
    logits = lm_head(norm(h))                                over the draft vocabulary
    next step's fused state = h (before the norm)

At position i the draft reads token i+1 and the teacher states of position i and predicts token
i+2 (vLLM's first pass shifts the tokens by one). Embeddings are the teacher's, frozen (the export
leaves them out: vLLM shares the target's). The draft LM head covers `draft_vocab_size` tokens: the
most frequent ones in `eagle3.vocab_from` (a JSONL dataset, e.g. the teacher's, a spool folder
or a token_freq.pt), counted once before training by every rank alike (not from the stream: the
head's size and order must be fixed before the first step); it starts from the teacher LM head's rows of those tokens. `d2t[d] = target_id - d` and the
bool mask `t2d` [V] are vLLM's / speculators' / SpecForge's convention.

Training-time test (TTT): the same layer is unrolled `ttt_steps` times. Step k at anchor i
reads token i+k+1 and the previous step's output at anchor i, sits at position i+k, and attends
to step 0's keys of positions 0..i plus its own anchor's keys of steps 1..k: exactly what vLLM's
draft KV cache holds when it proposes token k+1 from anchor i. Step k's target is the teacher's
next-token distribution at position i+k+1, recomputed from the last teacher layer (pre-norm) with
the teacher's final norm and LM head (`student.model.TeacherHead`), restricted to the draft
vocabulary and renormalised; positions where the teacher's top token is outside the draft
vocabulary, padding, and positions with `loss_mask` 0 do not count. Step k weighs `ttt_decay**k`.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from distill.config import eagle3_layer_ids
from student.config import StudentConfig
from student.errors import StudentError
from student.model import TeacherHead, checkpoint_tensors

ARCHITECTURE = "LlamaForCausalLMEagle3"  # vLLM: llama_eagle3.Eagle3LlamaForCausalLM
INIT_STD = 0.02
MAX_TTT_STEPS = 8  # student.eagle3.ttt_steps' bound
# The terms draft_loss reports: step k's loss and its top-1 agreement with the teacher.
TERMS = tuple(f"{name}{k}" for k in range(MAX_TTT_STEPS) for name in ("ttt", "acc"))


def reported_terms(cfg: StudentConfig) -> list[str]:
    return [f"{name}{k}" for k in range(cfg.eagle3.ttt_steps) for name in ("ttt", "acc")]


def export_dtype(cfg: StudentConfig) -> torch.dtype:
    """student.eagle3.export_dtype, else the teacher's dtype (its config.json), else float32."""
    name = cfg.eagle3.export_dtype
    if name is None:
        conf = json.loads((Path(cfg.teacher_model) / "config.json").read_text())
        name = conf.get("dtype") or conf.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def aux_layer_ids(cfg: StudentConfig, num_layers: int) -> list[int]:
    """The three auxiliary teacher layer ids, ascending (vLLM concatenates them in that order)."""
    ids = cfg.eagle3.aux_layer_ids or eagle3_layer_ids(num_layers)[:3]
    if len(ids) != 3 or len(set(ids)) != 3:
        raise StudentError(
            f"eagle3 needs 3 distinct auxiliary teacher layers, got {ids} (for a {num_layers}-layer "
            "teacher the default [2, n//2, n-3] collides: set student.eagle3.aux_layer_ids)"
        )
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise StudentError(
            f"student.eagle3.aux_layer_ids {ids}: ids must be in 0..{num_layers - 1} (the teacher has "
            f"{num_layers} layers; vLLM captures the input of decoder layer i as id i)"
        )
    return sorted(ids)


# --- the draft vocabulary -------------------------------------------------------------------------


def vocab_maps(
    counts: torch.Tensor, draft_vocab_size: int, always: list[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent target tokens.

    Args:
        counts: [V] token frequencies over the target vocabulary.
        draft_vocab_size: tokens kept (ties: lower id first).
        always: token ids kept whatever their count (e.g. EOS).

    Returns:
        d2t: [Vd] int64, target_id - draft_id, draft ids ordered by target id (vLLM's `d2t`).
        t2d: [V] bool, True on kept target ids.
    """
    vocab = counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise StudentError(f"student.eagle3.draft_vocab_size {draft_vocab_size} must be in 1..{vocab}")
    score = counts.double().clone()
    score[list(always)] = math.inf
    # Stable: equal counts keep ascending ids.
    order = torch.sort(-score, stable=True).indices[:draft_vocab_size]
    target_ids = torch.sort(order).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    d2t = target_ids - torch.arange(draft_vocab_size)
    return d2t.long(), t2d


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """[Vd] target id of every draft id (what vLLM computes as `arange + d2t`)."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def target_to_draft(t2d: torch.Tensor) -> torch.Tensor:
    """[V] draft id of every target id, -1 where the target token has no draft id."""
    out = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d, out, torch.full_like(out, -1))


def token_counts(source: str, tokenizer_dir: str, vocab: int) -> torch.Tensor:
    """[V] int64 token frequencies from a JSONL dataset (`text`, `messages`, `prompt` or
    `token_ids`/`input_ids` per row, tokenised with the teacher's tokenizer), a spool folder (the
    `token_ids` of every `*.safetensors` file where its `loss_mask` is 1: a generated answer's
    tokens, not its prompt's) or a `.pt` file (a [V] tensor of counts, e.g.
    speculators' token_freq.pt, or a {token_id: count} dict)."""
    p = Path(source)
    counts = torch.zeros(vocab, dtype=torch.long)
    if not p.exists():
        raise StudentError(f"student.eagle3.vocab_from {source!r} does not exist")
    if p.is_dir():
        from safetensors import safe_open

        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise StudentError(f"student.eagle3.vocab_from {source!r}: no *.safetensors spool files in it")
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                names = set(fh.keys())
                if "token_ids" not in names:
                    continue
                ids = fh.get_tensor("token_ids").long().flatten()
                if "loss_mask" in names:  # the tokens the draft learns to predict, not the prompts
                    mask = fh.get_tensor("loss_mask").flatten().bool()
                    if mask.numel() == ids.numel():
                        ids = ids[mask]
                counts += torch.bincount(ids, minlength=vocab)[:vocab]
        return counts
    if p.suffix == ".pt":
        obj = torch.load(str(p), map_location="cpu", weights_only=True)
        if isinstance(obj, dict):
            for k, v in obj.items():
                if 0 <= int(k) < vocab:
                    counts[int(k)] += int(v)
            return counts
        t = torch.as_tensor(obj).long().flatten()
        counts[: min(vocab, t.numel())] = t[:vocab]
        return counts
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    c: Counter = Counter()
    with open(p) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise StudentError(f"student.eagle3.vocab_from {source!r} line {n}: not JSON") from None
            ids = row.get("token_ids") or row.get("input_ids")
            if ids is None and row.get("messages"):
                ids = tok.apply_chat_template(row["messages"], tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) else ids
            if ids is None:
                text = row.get("text") or row.get("prompt")
                if not isinstance(text, str):
                    raise StudentError(
                        f"student.eagle3.vocab_from {source!r} line {n}: no text, prompt, messages or token_ids"
                    )
                ids = tok(text)["input_ids"]
            c.update(int(i) for i in ids)
    for i, v in c.items():
        if 0 <= i < vocab:
            counts[i] += v
    return counts


# --- the draft ------------------------------------------------------------------------------------


def draft_config(tconf, e3, aux_ids: list[int], draft_vocab: int) -> LlamaConfig:
    """The draft's Llama config (also its exported config.json): the teacher's widths unless set."""
    heads = e3.num_attention_heads or tconf.num_attention_heads
    head_dim = e3.head_dim or getattr(tconf, "head_dim", None) or tconf.hidden_size // heads
    rope = getattr(tconf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    conf = LlamaConfig(
        hidden_size=tconf.hidden_size,
        intermediate_size=e3.intermediate_size or tconf.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=e3.num_key_value_heads or getattr(tconf, "num_key_value_heads", heads),
        head_dim=head_dim,
        hidden_act=getattr(tconf, "hidden_act", "silu"),
        vocab_size=tconf.vocab_size,
        max_position_embeddings=tconf.max_position_embeddings,
        rms_norm_eps=getattr(tconf, "rms_norm_eps", 1e-6),
        rope_parameters=dict(rope),
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=getattr(tconf, "bos_token_id", None),
        eos_token_id=getattr(tconf, "eos_token_id", None),
        pad_token_id=getattr(tconf, "pad_token_id", None),
    )
    conf.architectures = [ARCHITECTURE]
    conf.draft_vocab_size = draft_vocab
    conf.target_hidden_size = tconf.hidden_size
    conf.norm_before_residual = bool(e3.norm_before_residual)
    conf.eagle_aux_hidden_state_layer_ids = list(aux_ids)
    conf.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True}
    return conf


class Eagle3Attention(nn.Module):
    """Llama attention over the 2H input, with the TTT cache layout (see the module docstring)."""

    def __init__(self, conf: LlamaConfig):
        super().__init__()
        h, self.heads, self.kv_heads, self.head_dim = (
            conf.hidden_size,
            conf.num_attention_heads,
            conf.num_key_value_heads,
            conf.head_dim,
        )
        self.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)

    def forward(self, x, cos, sin, cache: list, key_mask: torch.Tensor):
        """x [B, T, 2H]; cos/sin [B, T, D] for this step's positions; `cache` holds (k, v) of the
        previous steps ([B, heads, T, D], RoPE applied); key_mask [B, T] real tokens. Step 0
        attends causally over its own keys; step k > 0 over step 0's keys j <= i and the keys of
        steps 1..k at its own anchor i."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        cache.append((k, v))
        scale = self.head_dim**-0.5
        k0, v0 = cache[0]
        scores = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B, h, T, T]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        allowed = causal[None, None] & key_mask[:, None, None, :].bool()
        # A padded query row may see no key at all: let it see itself (its output is never used).
        allowed = allowed | torch.eye(t, dtype=torch.bool, device=x.device)[None, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        if len(cache) == 1:
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out = torch.matmul(probs, v0)
        else:
            diag = torch.stack([(q * ks).sum(-1) * scale for ks, _ in cache[1:]], dim=-1)  # [B, h, T, k]
            probs = torch.softmax(torch.cat([scores, diag], dim=-1).float(), dim=-1).to(q.dtype)
            out = torch.matmul(probs[..., :t], v0)
            for s, (_, vs) in enumerate(cache[1:]):
                out = out + probs[..., t + s, None] * vs
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class Eagle3Midlayer(nn.Module):
    """vLLM's EAGLE-3 layer 0 (`midlayer.*` in the checkpoint)."""

    def __init__(self, conf: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(conf.hidden_size, eps=conf.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(conf.hidden_size, eps=conf.rms_norm_eps)
        self.self_attn = Eagle3Attention(conf)
        self.post_attention_layernorm = LlamaRMSNorm(conf.hidden_size, eps=conf.rms_norm_eps)
        self.mlp = LlamaMLP(conf)
        self.norm_before_residual = bool(conf.norm_before_residual)

    def forward(self, embeds, hidden, cos, sin, cache, key_mask):
        """Returns the layer's output before the final norm (the next step's hidden input)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = residual + self.self_attn(x, cos, sin, cache, key_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class TeacherParts(nn.Module):
    """The teacher's frozen embeddings, final norm and LM head (read from its checkpoint)."""

    def __init__(self, embed: torch.Tensor, head: TeacherHead):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed.float(), freeze=True)
        self.head = head
        self.requires_grad_(False)

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    @torch.no_grad()
    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H] last teacher layer (before the final norm) -> [B, T, V] teacher logits (fp32)."""
        return self.head(last_hidden.float())


class Eagle3Draft(nn.Module):
    """The trained draft: fc, midlayer, norm, lm_head. Buffers: d2t [Vd], t2d [V], draft_ids [Vd]
    (target id of each draft id)."""

    def __init__(self, conf: LlamaConfig, head: TeacherHead, d2t, t2d, ttt_steps: int):
        super().__init__()
        self.config = conf
        h = conf.hidden_size
        self.ttt_steps = ttt_steps
        self.fc = nn.Linear(3 * conf.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Midlayer(conf)
        self.norm = LlamaRMSNorm(h, eps=conf.rms_norm_eps)
        self.lm_head = nn.Linear(h, conf.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(conf)
        self.register_buffer("d2t", d2t.long(), persistent=True)
        self.register_buffer("t2d", t2d.bool(), persistent=True)
        self.register_buffer("draft_ids", draft_to_target(d2t.long()), persistent=False)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for mod in (self.fc, *self.midlayer.self_attn.children(), *self.midlayer.mlp.children()):
                if isinstance(mod, nn.Linear):
                    mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * INIT_STD)
            # The draft head starts as the teacher head's rows of the draft vocabulary.
            self.lm_head.weight.copy_(head.lm_head.weight[self.draft_ids])

    def step_positions(self, t: int, k: int, b: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = (torch.arange(t, device=device) + k).unsqueeze(0).expand(b, t)
        dummy = torch.empty(0, device=device, dtype=self.fc.weight.dtype)
        return self.rotary_emb(dummy, pos)

    def forward(self, embeds: torch.Tensor, aux: torch.Tensor, mask: torch.Tensor, steps: int | None = None):
        """embeds [B, T, H] the teacher embeddings of the batch's tokens (`TeacherParts.embed`);
        aux [B, T, 3H_t] (the 3 auxiliary teacher states, ascending ids); mask [B, T] real tokens.
        Returns [steps] draft logits [B, T, Vd]: step k at anchor i reads token i+k+1 and predicts
        token i+k+2 (inputs shifted beyond the end are zeros; never scored)."""
        steps = steps or self.ttt_steps
        b, t, _ = embeds.shape
        hidden = self.fc(aux.to(self.fc.weight.dtype))
        cache: list = []
        out = []
        for k in range(steps):
            shifted = torch.zeros_like(embeds, dtype=hidden.dtype)
            if t > k + 1:
                shifted[:, : t - k - 1] = embeds[:, k + 1 :]
            cos, sin = self.step_positions(t, k, b, embeds.device)
            hidden = self.midlayer(shifted, hidden, cos, sin, cache, mask)
            out.append(self.lm_head(self.norm(hidden)))
        return out


# --- the three entry points -----------------------------------------------------------------------


def build_draft(cfg: StudentConfig) -> tuple[Eagle3Draft, TeacherParts, list[int]]:
    """The draft for `cfg` (recipe eagle3), the frozen teacher parts, and the teacher layer ids
    each batch must carry (the 3 auxiliary ids, then the last layer n).

    Raises:
        StudentError: missing/mismatched teacher checkpoint, bad layer ids or vocabulary source.
    """
    e3 = cfg.eagle3
    folder = Path(cfg.teacher_model)
    if not (folder / "config.json").is_file():
        raise StudentError(f"student.teacher_model {cfg.teacher_model!r} has no config.json")
    tconf = AutoConfig.from_pretrained(str(folder))
    n = tconf.num_hidden_layers
    aux = aux_layer_ids(cfg, n)
    vocab = tconf.vocab_size
    dv = e3.draft_vocab_size or vocab
    source = e3.vocab_from
    if dv < vocab and source is None:
        raise StudentError(
            "student.eagle3.draft_vocab_size is below the teacher's vocabulary: set student.eagle3.vocab_from "
            "(a JSONL dataset, a spool folder or a token_freq.pt) to count token frequencies"
        )
    eos = getattr(tconf, "eos_token_id", None)
    always = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None and 0 <= e < vocab]
    counts = token_counts(source, str(folder), vocab) if dv < vocab else torch.zeros(vocab, dtype=torch.long)
    d2t, t2d = vocab_maps(counts, dv, always)
    conf = draft_config(tconf, e3, aux, dv)
    head = TeacherHead.from_checkpoint(str(folder))
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        skeleton = AutoModelForCausalLM.from_config(tconf)
    emb_mod = skeleton.get_input_embeddings()
    emb_name = next(f"{p}.weight" for p, m in skeleton.named_modules() if m is emb_mod)
    embed = checkpoint_tensors(folder, [emb_name]).get(emb_name)
    if embed is None:
        raise StudentError(f"teacher checkpoint {str(folder)!r} lacks {emb_name} (the draft's embeddings)")
    torch.manual_seed(cfg.seed)
    model = Eagle3Draft(conf, head, d2t, t2d, e3.ttt_steps)
    model.token_counts = counts  # written to the export's token_freq.pt
    return model, TeacherParts(embed, head), aux + [n]


def draft_loss(
    model: nn.Module, frozen: TeacherParts, batch, cfg: StudentConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch: sum over TTT steps k of ttt_decay**k * the soft cross-entropy
    between the teacher's next-token distribution (draft vocabulary, renormalised) and the
    draft's, mean over scored positions. `batch.teacher` holds the layers of `build_draft`'s ids
    (3 auxiliary, then the last); with `student.loss_on: masked` (the eagle3 default) only positions
    whose `batch.loss_mask` is set count (all when the batch has none).

    Returns the loss and detached terms: `ttt{k}` (step k's loss) and `acc{k}` (step k's top-1
    agreement with the teacher, the fraction of scored positions). A batch with nothing scored
    gives exactly 0 (zero-weight steps)."""
    if getattr(batch, "lengths", None) is not None:
        batch = batch.to(batch.input_ids.device)
    inner = model.module if hasattr(model, "module") else model
    e3 = cfg.eagle3
    pos = {lid: i for i, lid in enumerate(batch.layer_ids)}
    last_id = max(batch.layer_ids)
    aux_ids = sorted(i for i in batch.layer_ids if i != last_id)
    b, t = batch.input_ids.shape
    aux = batch.teacher[:, :, [pos[i] for i in aux_ids]].reshape(b, t, -1)
    valid = batch.mask.bool()
    lm = getattr(batch, "loss_mask", None) if cfg.loss_on == "masked" else None
    if lm is not None:
        valid = valid & lm.to(valid.device).bool()
    with torch.no_grad():
        t_logits = frozen.logits(batch.teacher[:, :, pos[last_id]])  # [B, T, V]
        top = t_logits.argmax(-1)
        in_draft = inner.t2d[top]  # the teacher's top token has a draft id
        t_logp = torch.log_softmax(t_logits.index_select(-1, inner.draft_ids) / e3.target_temperature, dim=-1)
        t_top = top
        del t_logits
    logits = model(frozen.embed(batch.input_ids), aux, batch.mask)
    loss = logits[0].new_zeros(())
    terms: dict[str, torch.Tensor] = {}
    for k, lg in enumerate(logits):
        # Step k at anchor i matches the teacher at position p = i+k+1 (anchors 0..T-k-2).
        span = t - k - 1
        if span <= 0:
            zero = lg.sum() * 0.0
            terms[f"ttt{k}"], terms[f"acc{k}"] = zero.detach(), zero.detach()
            loss = loss + zero
            continue
        w = (valid[:, k + 1 :] & in_draft[:, k + 1 :]).to(lg.dtype)  # [B, span]
        n = w.sum().clamp(min=1.0)
        s_logp = torch.log_softmax(lg[:, :span].float(), dim=-1)
        p = t_logp[:, k + 1 :].exp()
        ce = -(p * s_logp).sum(-1)  # [B, span]
        step_loss = (ce * w).sum() / n
        with torch.no_grad():
            pred = inner.draft_ids[lg[:, :span].argmax(-1)]
            acc = ((pred == t_top[:, k + 1 :]).to(w.dtype) * w).sum() / n
        terms[f"ttt{k}"], terms[f"acc{k}"] = step_loss.detach(), acc
        loss = loss + (e3.ttt_decay**k) * step_loss
    return loss, terms


def export_draft(model: nn.Module, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the draft in vLLM 0.32's EAGLE-3 layout: config.json (LlamaForCausalLMEagle3,
    draft_vocab_size, norm_before_residual, eagle_aux_hidden_state_layer_ids) and
    model.safetensors (fc, midlayer.*, norm, lm_head, d2t, t2d; no embed_tokens: vLLM shares the
    target's), plus token_freq.pt (the counts the draft vocabulary came from)."""
    inner = model.module if hasattr(model, "module") else model
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    conf = inner.config
    dtype = dtype or torch.float32
    sd = {}
    for name, p in inner.state_dict().items():
        if name.startswith("rotary_emb.") or name in ("d2t", "t2d", "draft_ids"):
            continue
        sd[name] = p.detach().to("cpu", dtype).contiguous()
    if conf.draft_vocab_size != conf.vocab_size:  # vLLM has no d2t parameter for a full vocabulary
        sd["d2t"] = inner.d2t.detach().cpu().long().contiguous()
        sd["t2d"] = inner.t2d.detach().cpu().bool().contiguous()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    d = conf.to_dict()
    d["architectures"] = [ARCHITECTURE]
    d["dtype"] = str(dtype).replace("torch.", "")
    for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual"):
        d[key] = getattr(conf, key)
    d["eagle_aux_hidden_state_layer_ids"] = list(conf.eagle_aux_hidden_state_layer_ids)
    d["eagle_config"] = dict(conf.eagle_config)
    (folder / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    counts = getattr(inner, "token_counts", None)
    if counts is not None:
        torch.save(counts.cpu(), str(folder / "token_freq.pt"))
    return folder


__all__ = [
    "Eagle3Draft",
    "TeacherParts",
    "aux_layer_ids",
    "build_draft",
    "draft_loss",
    "draft_to_target",
    "eagle3_layer_ids",
    "export_draft",
    "target_to_draft",
    "token_counts",
    "vocab_maps",
]
