"""``draft``: a smaller model of the same tokenizer guesses the next tokens greedily, on a KV cache of its own.

Options (``[proposers.draft]``):

* ``model``: any model kvcore loads (``smollm2``, a .gguf file, a Hugging Face directory), loaded in the
  target's dtype, device and weight format; its vocabulary and tokenizer must be the target's. Default: the
  target model itself (its weights shared, nothing loaded).
* ``weights``: the draft model's weight format (an ``EngineConfig.weights`` value; default: the target's), e.g. an
  ``int4a8`` draft for a target run on dense weights.
* ``num_layers``: run only the draft's first ``num_layers`` decoder layers (then its final norm and LM
  head): a layer-truncated copy, sharing the weights, e.g. SmolLM2's first 8 of 30 layers.
* ``misses`` (2), ``cooldown`` (16): back-off, as the ``ngram`` proposer's (:mod:`kvcore.speculative.backoff`):
  the number of drafts adapts to what verifications keep, and a request whose drafts keep failing stops
  drafting (no draft forward, no verification) for a cooldown that doubles, then probes with one draft. A
  draft that is rarely right thus costs little more than decoding without speculation.

The draft runs as the engine runs a model of its kind: on ``cpu_decode`` where that backend can (the fused layers'
native stack, a verification's kernel for the few tokens fed after one), else on ``sdpa``; a draft that shares the
target's weights computes its logits with the target's LM head, a draft model of its own with the int4 head where
its weights are quantized (the top candidates rescored exactly), else the dense one. So a draft that is the target
itself proposes the target's own greedy tokens.

Each request has a sequence in the draft's contiguous KV cache. A proposal first feeds the tokens the draft
has not seen (a new request's prompt in a forward of its own, as the target's prefill ran it, then its output; after
the last verification: the kept drafts and the target's own token; after a cooldown: every token since its last
proposal, in one chunk; its cache keeps the longest prefix it shares with the request's tokens), then one greedy
token at a time. Greedy drafts are deterministic, so sampled requests
verify them with one-hot ``q``.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.cpu_decode import CPUDecodeBackend
from kvcore.backends.sdpa import SDPABackend
from kvcore.errors import ConfigError
from kvcore.execution.runner import last_token_logits, run_model
from kvcore.hookspecs import hookimpl
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.interfaces.proposer import Proposal, Proposer, ProposerCapabilities, ProposerTarget
from kvcore.kernels.quant import QUANTIZED_FORMATS
from kvcore.model.embedding import head_rows
from kvcore.model.lm_head import RescoredInt4Head, check_lm_head
from kvcore.scheduling.kv_manager import KVCacheManager
from kvcore.speculative.backoff import Backoff, DraftLength, check_positive

#: text whose tokens a draft's tokenizer must give exactly as the target's does
TOKENIZER_PROBE = "Speculative decoding: the draft's tokens must be the target's. 0123 {x: [1, 2]} é 中"


def truncated(model, num_layers: int):
    """``model`` running only its first ``num_layers`` decoder layers: a shallow copy sharing every weight."""
    draft = copy.copy(model)
    draft.config = dataclasses.replace(model.config, num_hidden_layers=num_layers)
    draft.attention_layers = tuple(model.attention_layers[:num_layers])
    return draft


class DraftModelProposer(Proposer):
    name = "draft"
    description = "a smaller model of the same tokenizer (or the target's first layers), greedy, own KV cache"
    capabilities = ProposerCapabilities(deterministic=True, needs_model=True)

    def __init__(self, model: str | None = None, num_layers: int | None = None, misses: int = 2,
                 cooldown: int = 16, weights: str | None = None) -> None:
        super().__init__()
        check_positive("draft", misses=misses, cooldown=cooldown)
        self.backoff = Backoff(misses, cooldown)
        self._lengths: dict[str, DraftLength] = {}
        if num_layers is not None and (not isinstance(num_layers, int) or isinstance(num_layers, bool)
                                       or num_layers < 1):
            raise ConfigError(f"proposer 'draft': num_layers must be a positive integer, got {num_layers!r}")
        if model is not None and not (isinstance(model, str) and model):
            raise ConfigError(f"proposer 'draft': model must name a model, got {model!r}")
        if weights is not None and model is None:
            raise ConfigError("proposer 'draft': weights sets the format of a draft model loaded with model; without "
                              "one the draft shares the target's weights")
        if weights is not None and not (isinstance(weights, str) and weights):
            raise ConfigError(f"proposer 'draft': weights must name a weight format, got {weights!r}")
        self.model_spec, self.num_layers, self.weights = model, num_layers, weights
        self._seqs: dict[str, tuple[int, list[int]]] = {}  # request id -> (draft sequence, tokens it holds)
        self._next_seq = 0

    def bind(self, target: ProposerTarget) -> list[str]:
        model, tokenizer, self.head = target.model, target.tokenizer, target.lm_head
        if self.model_spec is not None:
            model, tokenizer = (target.load_model(self.model_spec, self.weights) if self.weights is not None
                                else target.load_model(self.model_spec))
            reasons = self._tokenizer_reasons(model, tokenizer, target)
            if reasons:
                return reasons
            self.head = _own_head(model, target.device)
        layers = model.config.num_hidden_layers
        if self.num_layers is not None:
            if self.num_layers > layers:
                return [f"num_layers {self.num_layers} exceeds the draft model's {layers} layers"]
            model = truncated(model, self.num_layers)
        self.model, self.backend = model, None
        c = model.config
        shape = dict(device=target.device, dtype=model.dtype, head_dim=c.head_dim, num_heads=c.num_attention_heads,
                     num_kv_heads=c.num_key_value_heads)
        caps = CPUDecodeBackend.capabilities
        if (target.device.type in caps.devices and model.dtype in caps.dtypes
                and CPUDecodeBackend.availability() is None):
            fast = CPUDecodeBackend()
            if not fast.validate(**shape):
                self.backend = fast
        if self.backend is None:
            self.backend = SDPABackend()
            reasons = self.backend.validate(**shape)
            if reasons:
                return [f"the draft model cannot run on sdpa: {'; '.join(reasons)}"]
        spec = CacheSpec(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                         dtype=model.dtype, device=target.device, max_num_seqs=target.max_num_seqs,
                         max_seq_len=target.max_model_len)
        self.kv = KVCacheManager(ContiguousKVCache(spec))
        return []

    @staticmethod
    def _tokenizer_reasons(model, tokenizer, target: ProposerTarget) -> list[str]:
        if model.config.vocab_size != target.vocab_size:
            return [f"the draft's vocabulary ({model.config.vocab_size}) is not the target's ({target.vocab_size})"]
        if tokenizer is not None and target.tokenizer is not None:
            if tokenizer.encode(TOKENIZER_PROBE) != target.tokenizer.encode(TOKENIZER_PROBE):
                return ["the draft's tokenizer splits text differently from the target's"]
        return []

    def advance(self, request_id, num_proposed, num_accepted) -> None:
        self.backoff.advance(self._lengths.setdefault(request_id, DraftLength()), num_proposed, num_accepted)

    def finish(self, request_id) -> None:
        self._lengths.pop(request_id, None)
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free_sequence(seq[0])

    def _sequence(self, request_id: str, tokens: list[int]) -> tuple[int, list[int]]:
        """The request's draft sequence, cut back to the longest prefix it shares with ``tokens`` (at least
        one token of ``tokens`` is left to feed)."""
        if request_id not in self._seqs:
            self._seqs[request_id] = (self._next_seq, [])
            self.kv.add_sequence(self._next_seq)
            self._next_seq += 1
        seq_id, held = self._seqs[request_id]
        keep = 0
        for a, b in zip(held, tokens[:-1]):
            if a != b:
                break
            keep += 1
        self.kv.truncate(seq_id, keep)
        return seq_id, held[:keep]

    @torch.inference_mode()
    def propose(self, rows, num_tokens) -> list[Proposal]:
        num_tokens = [self.backoff.drafts(self._lengths.setdefault(r.request_id, DraftLength()), k)
                      for r, k in zip(rows, num_tokens)]
        drafting = [i for i, k in enumerate(num_tokens) if k > 0]
        out = [Proposal() for _ in rows]
        if drafting:  # a step in which every row cools down runs no draft forward
            got = self._drafts([rows[i] for i in drafting], [num_tokens[i] for i in drafting])
            for i, proposal in zip(drafting, got):
                out[i] = proposal
        return out

    def _drafts(self, rows, num_tokens) -> list[Proposal]:
        seqs, feeds, held, prompts = [], [], [], []
        for row in rows:
            tokens = row.prompt_ids + row.output_ids
            seq_id, kept = self._sequence(row.request_id, tokens)
            seqs.append(seq_id)
            # prompt tokens the draft has not seen go first, on their own, as the target's prefill ran them; then
            # the output tokens, as few rows after the cache (as the target's decode steps and verifications ran
            # them): a draft that is the target computes each of its tokens as the target did
            split = max(len(kept), min(len(row.prompt_ids), len(tokens) - 1))
            prompts.append(tokens[len(kept):split])
            feeds.append(tokens[split:])
            held.append(tokens)
        starting = [i for i, p in enumerate(prompts) if p]
        if starting:
            meta = self.kv.prepare([seqs[i] for i in starting], [len(prompts[i]) for i in starting],
                                   self.model.attention_scale, self.model.attention_layers)
            run_model(self.model, self.backend, self.kv.cache, meta, [t for i in starting for t in prompts[i]])
        drafts: list[list[int]] = [[] for _ in rows]
        active = list(range(len(rows)))
        for _ in range(max(num_tokens)):
            meta = self.kv.prepare([seqs[i] for i in active], [len(feeds[i]) for i in active],
                                   self.model.attention_scale, self.model.attention_layers)
            ids = [t for i in active for t in feeds[i]]
            logits = last_token_logits(self.model, self.backend, self.kv.cache, meta, ids, head=self.head)
            picks = logits.argmax(-1).tolist()
            for i, pick in zip(active, picks):
                drafts[i].append(pick)
                feeds[i] = [pick]
            active = [i for i in active if len(drafts[i]) < num_tokens[i]]
            if not active:
                break
        for i, row in enumerate(rows):  # the cache holds the tokens and every draft but the last
            self._seqs[row.request_id] = (seqs[i], held[i] + drafts[i][:-1])
        return [Proposal(d) for d in drafts]


def _own_head(model, device) -> RescoredInt4Head | None:
    """A separate draft model's LM head: int4, the fastest packed head (the top candidates rescored; a draft's
    accuracy moves only how many of its tokens are kept), for quantized weights where the int4 kernel runs and takes
    the head's shape, else None (dense)."""
    fmt = getattr(model, "weight_format", "float")
    if fmt not in QUANTIZED_FORMATS:
        return None
    try:
        check_lm_head("int4", model.dtype, device)
        return RescoredInt4Head(head_rows(model), a8=fmt in ("int4a8", "gguf"))
    except ConfigError:
        return None


@hookimpl
def kvcore_register_proposers(register):
    register(DraftModelProposer)
