"""Prefill and decode workers wired together in one process, without Ray.

`hisparse generate` runs on this, tests compare the PD split against it, and the serving benchmark
uses it as the single-process baseline. The same worker classes run inside the Ray actors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cachetier.store import KVStore, TieredStore
from core.configs import PrefillConfig, StepConfig, TierConfig
from core.request import Attempt, Request
from core.types import PromptLogprob, RequestFailed, TokenEvent
from decode.worker import DecodeRequest, DecodeWorker
from model.grammar import GrammarEngine
from model.model import V4Model
from prefill.worker import PrefillResult, PrefillWorker


def decode_request(res: PrefillResult) -> DecodeRequest:
    """A prefill's result as the decode worker takes it."""
    return DecodeRequest(res.attempt, res.first_token, res.num_generated, layout=res.layout)


@dataclass
class Completion:
    request_id: str
    events: list[TokenEvent] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None

    @property
    def token_ids(self) -> list[int]:
        return [e.token.token_id for e in self.events]

    @property
    def finish_reason(self) -> str | None:
        return self.events[-1].finish_reason if self.events else None


class InProcessEngine:
    def __init__(
        self,
        model: V4Model,
        tier: TierConfig | None = None,
        prefill: PrefillConfig | None = None,
        store: KVStore | None = None,
        eos_ids: tuple[int, ...] | None = None,
        step: StepConfig | None = None,
        grammar: GrammarEngine | None = None,
    ) -> None:
        """`eos_ids`: the model's end-of-sequence ids (`model.config.end_of_sequence_ids`); default: its config's.
        `grammar`: the engine constrained requests need (`model.grammar.GrammarEngine`)."""
        tier = tier or TierConfig()
        self.model = model
        self.eos_ids = model.cfg.eos_token_ids if eos_ids is None else eos_ids
        self.prefill = PrefillWorker(model, prefill, eos_ids=self.eos_ids, grammar=grammar)
        self.store = store if store is not None else TieredStore(model.cfg, tier, dtype=model.dtype, device=model.device)
        self.decode = DecodeWorker(model, self.store, max_running=tier.max_running, eos_ids=self.eos_ids,
                                   step_config=step, grammar=grammar)

    def generate(self, requests: Iterable[Request],
                 on_event: Callable[[TokenEvent], None] | None = None) -> dict[str, Completion]:
        """Run requests to completion (each with its own seed, `core.request`); `on_event` sees every token as it
        is produced (for timing)."""
        out: dict[str, Completion] = {}
        for r in requests:
            self.prefill.submit(Attempt.of(r))
            out[r.request_id] = Completion(r.request_id)
        while self.prefill.has_work() or self.decode.has_work():
            for res in self.prefill.step():
                out[res.key].prompt_logprobs = res.prompt_logprobs
                if res.first_token is None:
                    continue  # scoring only
                ev = TokenEvent(res.key, 0, res.first_token, res.finish_reason)
                out[res.key].events.append(ev)
                if on_event is not None:
                    on_event(ev)
                if res.finish_reason is None:
                    self.decode.submit(decode_request(res))
            for ev in self.decode.step():
                out[ev.request_id].events.append(ev)
                if on_event is not None:
                    on_event(ev)
            failed = self.prefill.take_failures() + self.decode.take_failures()
            if failed:
                raise RequestFailed(f"request {failed[0].request_id} failed: {failed[0].message}")
        return out

    def close(self) -> None:
        self.decode.close()
