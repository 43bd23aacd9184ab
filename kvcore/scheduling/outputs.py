"""One sampled token settled into its request: the grammar's check, the output and logprobs, the metrics, the
stop checks (EOS, stop ids and strings, length, context, a complete structured output) and the event.

:meth:`~kvcore.scheduling.scheduler.Scheduler.update_from_output` calls :func:`emit` once per token a row
emits, in order, and finishes the request when the event says it ended.
"""

from __future__ import annotations

import time

from kvcore.errors import GrammarError, KVCoreError
from kvcore.sampling.structured import dead_end
from kvcore.scheduling.batch import Sampled
from kvcore.scheduling.request import EngineStats, FinishReason, Request, TokenEvent

__all__ = ["emit"]


def emit(req: Request, num_computed: int, sampled: Sampled, stats: EngineStats, max_model_len: int, kv_bytes: int,
         events: list[TokenEvent]) -> TokenEvent:
    """Count ``num_computed`` more of ``req``'s tokens as computed, append ``sampled`` and its event to ``events``
    (together: an interruption leaves the request as it was or with all three) and return the event; its
    ``finish_reason`` says whether the request ends with it (``req.finish_reason`` is set then). ``kv_bytes``: what
    its K/V occupy now.

    A token the request's grammar refuses is not appended: the event then carries no token, the reason
    ``ERROR`` and the :class:`~kvcore.errors.GrammarError`."""
    req.num_computed_tokens += num_computed
    token_id, lp = sampled
    if req.matcher is not None:
        error = _refused(req, token_id)
        if error is not None:
            events.append(TokenEvent(req.request_id, None, "", FinishReason.ERROR, error))
            return events[-1]
    req.output_ids.append(token_id)
    if lp is not None:
        req.logprobs.append(lp[0])
        req.top_logprobs.append(lp[1])
    stats.num_generated_tokens += 1
    m = req.metrics
    m.num_generated_tokens = len(req.output_ids)
    if m.last_token_step != stats.num_steps:  # a verification gives several tokens in one step
        m.num_token_steps, m.last_token_step = m.num_token_steps + 1, stats.num_steps
    if m.first_token_time is None:
        m.first_token_time = time.perf_counter()
    m.kv_bytes = max(m.kv_bytes, kv_bytes)
    reason = req.stop_reason_after(token_id, max_model_len)
    out = req.text_output
    text, hit = out.push(token_id, reason is not None) if out is not None else ("", False)
    reason = FinishReason.STOP if hit else reason
    if reason is None and req.matcher is not None and req.matcher.is_stopped():
        reason = FinishReason.STOP  # the constrained output is complete: nothing but EOS may follow
    req.finish_reason = reason  # with the token: an interrupted finish cannot make it run on
    top = lp[1] if lp is not None else None
    events.append(TokenEvent(req.request_id, token_id, text, reason, None, lp[0] if lp else None, top))
    return events[-1]


def _refused(req: Request, token_id: int) -> KVCoreError | None:
    """Feed a sampled token to the request's grammar; why it cannot go on (None: it can). A token the grammar
    refuses (a sampler that ignored the mask) fails the request, and so does a grammar with no way on (its mask
    held only EOS, which llguidance takes and stays in error: the output would end early, as if complete)."""
    took = req.matcher.consume_token(token_id)
    if took and not req.matcher.is_error():
        return None
    if took:
        n = len(req.output_ids)
        return GrammarError(f"the structured output cannot be completed after {n} token{'s' * (n != 1)}: "
                            f"{dead_end(req.matcher)}")
    return GrammarError(f"token {token_id} breaks the request's structured output: {dead_end(req.matcher)}")
