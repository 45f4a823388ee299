"""The pruning engine: greedy generation with a KV cache under a per-request bypass plan.

One request = preprocessing (render + tokenize the prompt, match it to a calibrated domain,
choose the plan), inference (prefill + decode under the plan, counted by the execution ledger),
postprocessing (detokenize, optional quality check against the dense model, stats). The engine
returns plain `RequestStats`; it never writes to a database or a metrics registry itself.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast, overload

import torch

from prunewatch.engine._streaming import Completion, CompletionText, PromptEcho, RequestTimes, StreamRequest
from prunewatch.engine.anomaly import anomaly_reason
from prunewatch.engine.calibration import CALIBRATION_FORMAT_VERSION, Calibration, calibrate, mean_token_direction
from prunewatch.engine.dram_profile import DramProfile
from prunewatch.engine.errors import InvalidRequestError
from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, InstrumentedModel, executing, instrument
from prunewatch.engine.hardware import PeakMemory, device_name, estimate_dram_bytes_per_instruction
from prunewatch.engine.heads import HeadGating, install_head_gating
from prunewatch.engine.kv_cache import PREFILL_CHUNK, reserved_cache
from prunewatch.engine.loading import LoadedModel, load_model
from prunewatch.engine.logprobs import MAX_TOP_LOGPROBS, Scored, TokenLogprob, TokenTexts, score_positions
from prunewatch.engine.paths import calibration_cache
from prunewatch.engine.planner import BypassPlan, plan_bypass, validate_request
from prunewatch.engine.prefix_cache import PrefixCache
from prunewatch.engine.quality import answer_token_scores, divergence, quality_check, quality_report
from prunewatch.engine.settings import EngineSettings, LogLevel, output_head_target
from prunewatch.engine.signals import memory_pressure
from prunewatch.engine.stats import GenerationResult, QualityReport, RequestStats
from prunewatch.engine.threads import GenerationThreads

if TYPE_CHECKING:  # imported where they are first used: a dense engine never loads them
    from prunewatch.engine.batching import DecodeBatcher
    from prunewatch.engine.compiled_decode import CompiledDecode
    from prunewatch.engine.sparse import SparseLinear, SparsityInstallation
    from prunewatch.engine.sparse.output_head import ShortlistHead

logger = logging.getLogger("prunewatch.engine")


@dataclass(frozen=True)
class TokenDelta:
    """A piece of generated text, yielded while streaming; with `echo`, first the prompt's text."""

    text: str
    token_id: int
    # With logprobs asked for: the tokens this piece completes, those whose text begins in it (or before it,
    # held back for a stop sequence); `offset` counts characters of the completion (of the prompt when `echo`).
    logprobs: tuple[TokenLogprob, ...] = ()
    echo: bool = False  # the echoed prompt (stream(echo=True)), yielded before any generated piece


@dataclass(frozen=True)
class DecodeMeasurement:
    """One fixed-length greedy decode (PruningEngine.measure_decode)."""

    tokens: list[int]  # every generated token id, the first (from the prefill) included
    decode_s: float  # wall clock from the first generated token to the last: len(tokens) - 1 decode steps
    ledger: ExecutionLedger  # the work counted, prefill and decode apart

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0


# OpenAI allows 4; lm-eval's completions send a task's `until` strings plus the tokenizer's end-of-sequence text,
# uncapped (5 for a task with 4). Checking one more costs one str.find per generated token.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256  # streaming holds back one character less than the longest stop sequence


def stop_sequences(stop: Sequence[str] | str) -> tuple[str, ...]:
    """The request's stop strings, checked (InvalidRequestError): at most MAX_STOP_SEQUENCES, none empty (it would
    end every answer before its first character), none over MAX_STOP_CHARS. The server checks requests with it."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequestError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
    if any(not isinstance(s, str) or not s for s in stops):
        raise InvalidRequestError("stop sequences must be non-empty strings")
    if max((len(s) for s in stops), default=0) > MAX_STOP_CHARS:
        raise InvalidRequestError(f"a stop sequence is longer than {MAX_STOP_CHARS} characters")
    return stops


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class PruningEngine:
    """A causal LM that skips calibrated low-influence blocks per request and measures the skip."""

    def __init__(self, loaded: LoadedModel, settings: EngineSettings, calibration: Calibration | None = None) -> None:
        self.loaded = loaded
        self.settings = settings
        self.instrumented: InstrumentedModel = instrument(loaded.model)
        validate_request(self.num_layers, settings.sensitivity, settings.layer_blacklist)
        # None when head gating is off or the attention layout is unknown: requests then gate no head.
        self.head_gating: HeadGating | None = install_head_gating(self.instrumented) if settings.head_gating else None
        if settings.head_gating and self.head_gating is None:
            logger.warning("head gating is unavailable for %s: its attention layout is not recognised",
                           type(loaded.model).__name__)
        self._calibration: Calibration | None = None
        self._sparsity: SparsityInstallation | None = None  # once thresholds are calibrated
        self._output_head: ShortlistHead | None = None  # once enabled
        self._compiled: CompiledDecode | None = None  # built on first use when configured
        self._generation_thread: GenerationThreads | None = None  # started on first use (generation_thread)
        self._generation_thread_lock = threading.Lock()
        if calibration is not None:
            self.use_calibration(calibration)
        self.dram_profile = self._load_dram_profile(settings.dram_profile)
        model: Any = loaded.model  # a transformers model (typed as a plain nn.Module)
        tokenizer: Any = loaded.tokenizer
        config = model.config
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 1)
        kv_heads = cast(int, getattr(config, "num_key_value_heads", None) or heads)  # config fields are untyped
        hidden = getattr(config, "hidden_size", None) or config.n_embd
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        self._kv_bytes_per_token_per_layer = 2 * kv_heads * head_dim * torch.empty((), dtype=loaded.dtype).element_size()
        eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        self._eos_ids: set[int] = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.token_texts = TokenTexts(tokenizer)  # token ids as OpenAI clients read them (logprobs)
        marker = self._user_turn_marker()
        self.prefix_cache = PrefixCache(marker, settings.prefix_cache_entries, settings.prefix_cache_min_tokens,
                                        max_bytes=settings.prefix_cache_mib * 2**20,
                                        shared_heads=[self._template_head(marker)])

    @classmethod
    def load(cls, settings: EngineSettings, calibration: Calibration | None = None) -> PruningEngine:
        return cls(load_model(settings.model_dir, settings.device), settings, calibration)

    # -- facts -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def num_layers(self) -> int:
        return self.instrumented.num_layers

    @property
    def calibration(self) -> Calibration | None:
        return self._calibration

    @property
    def generation_thread(self) -> GenerationThreads:
        """This engine's own generation thread, for in-process callers that are not a server (the collector's
        targets): one long-lived thread with `settings.threads` intra-op threads, started on first use and shared
        by every caller, so probes of one engine run one at a time on one OpenMP team (prunewatch/engine/threads.py).
        The server runs its workers' own (prunewatch/server/admission.py)."""
        with self._generation_thread_lock:
            if self._generation_thread is None:
                self._generation_thread = GenerationThreads(1, self.settings.threads, name="prunewatch-engine")
            return self._generation_thread

    def new_batcher(self, max_batch: int, threads: int | None = None, *, gather_s: float = 0.05,
                    sparse_rows: int = 1, kv_budget_bytes: int | None = None) -> DecodeBatcher:
        """A continuous batcher for this engine's model (prunewatch.engine.batching): generations given it
        (`stream(batcher=...)`) decode together, up to `max_batch` sharing each decode step, on its stepper thread
        with `threads` intra-op threads (default: the engine's `threads` setting, else torch's). Their callers'
        threads then only detokenize and stream, so they should run with one intra-op thread. Compiled decode
        steps are not used in a batcher. `sparse_rows`: the largest step that keeps the requests' activation
        sparsity and output-head shortlist (larger ones run dense; prunewatch.engine.batching.batch_plan says
        why). `kv_budget_bytes`: the KV cache the requests in it may hold together (None: no bound); each reserves
        its prompt plus max new tokens at every layer when it joins. The caller closes it."""
        from prunewatch.engine.batching import DecodeBatcher

        return DecodeBatcher(self.instrumented, max_batch, threads or self.settings.threads, gather_s=gather_s,
                             sparse_rows=sparse_rows,
                             kv_bytes_per_token=self._kv_bytes_per_token_per_layer * self.num_layers,
                             kv_budget_bytes=kv_budget_bytes)

    # -- calibration -------------------------------------------------------------------------
    def use_calibration(self, calibration: Calibration) -> None:
        calibration.check_model(self.loaded.fingerprint, self.num_layers)
        self._calibration = calibration
        self.prefix_cache.clear()

    def calibrate(
        self,
        texts_by_domain: Mapping[str, Sequence[str]],
        corpus_digest: str,
        progress: Callable[[int, int], None] | None = None,
    ) -> Calibration:
        calibration = calibrate(
            self.instrumented,
            self.loaded.tokenizer,
            texts_by_domain,
            model_name=self.name,
            model_fingerprint=self.loaded.fingerprint,
            corpus_digest=corpus_digest,
            progress=progress,
            heads=self.head_gating,
        )
        self.use_calibration(calibration)
        return calibration

    def calibration_path(self, corpus_digest: str) -> Path:
        root = self.settings.calibration_dir or calibration_cache()
        heads = "-heads" if self.head_gating is not None else ""
        return root / (f"{self.name}-{self.loaded.fingerprint[:16]}-{corpus_digest[:12]}"
                       f"-v{CALIBRATION_FORMAT_VERSION}{heads}.json")

    def load_or_calibrate(
        self,
        texts_by_domain: Mapping[str, Sequence[str]],
        corpus_digest: str,
        progress: Callable[[int, int], None] | None = None,
    ) -> tuple[Calibration, bool]:
        """Use the cached calibration for this model and corpus if present (and, when activation sparsity
        is configured, install the kernel with its thresholds); returns (it, was_cached)."""
        path = self.calibration_path(corpus_digest)
        cached = path.is_file()
        if cached:
            calibration = Calibration.load(path)
            self.use_calibration(calibration)
        else:
            calibration = self.calibrate(texts_by_domain, corpus_digest, progress)
            calibration.save(path)
        quantized = self.settings.weights != "fp32"  # the wrappers hold the quantized weights, dense plans too
        if self.settings.activation_sparsity > 0.0 or quantized:
            self.enable_activation_sparsity(texts_by_domain, corpus_digest)
        if self.settings.output_head_sparsity > 0.0 or quantized:
            self.enable_output_head()
        return calibration, cached

    def enable_output_head(self) -> None:
        """Put the shortlist output head in place (prunewatch.engine.sparse.output_head): it runs dense until a
        request's plan asks for output-head sparsity. Raises SparseKernelUnavailableError where the
        device has no kernel, as activation sparsity does."""
        from prunewatch.engine.sparse.output_head import install_shortlist_head

        if self._output_head is None:
            self._output_head = install_shortlist_head(self.loaded.model, weights=self.settings.weights)

    def enable_activation_sparsity(self, texts_by_domain: Mapping[str, Sequence[str]], corpus_digest: str) -> None:
        """Calibrate per-layer input thresholds (cached beside the block calibration) and install the
        sparse kernel on every block's linear layers. Raises SparseKernelUnavailableError where the
        device has no kernel (no compiler on the CPU, no triton on CUDA, any other device): a sparse
        request is never run dense while reported as sparse."""
        from prunewatch.engine.sparse import install_sparsity
        from prunewatch.engine.sparse.calibration_cache import load_or_calibrate_sparsity
        from prunewatch.engine.sparse.module import SparsityOptions

        if self._sparsity is not None:
            return
        sparsity_calibration = load_or_calibrate_sparsity(self, texts_by_domain, corpus_digest)  # per settings
        self._sparsity = install_sparsity(self.instrumented, sparsity_calibration,
                                          SparsityOptions(weights=self.settings.weights,
                                                          quantized_sparse_from=self.settings.quantized_sparse_from),
                                          model_fingerprint=self.loaded.fingerprint)
        self.prefix_cache.clear()  # the heads were computed before any layer pruned

    # -- requests ----------------------------------------------------------------------------
    def _user_turn_marker(self) -> list[int]:
        """The tokens the chat template puts between a system prompt and the user's text (empty without a chat
        template): the common end of the heads of two renderings with different system prompts, each head being
        the common start of two renderings that differ only in the user's text."""
        if not getattr(self.loaded.tokenizer, "chat_template", None):
            return []

        def common_start(a: list[int], b: list[int]) -> list[int]:
            length = 0
            while length < min(len(a), len(b)) and a[length] == b[length]:
                length += 1
            return a[:length]

        heads = []
        try:
            for system in ("You answer briefly.", "Reply in plain words, please"):
                first, second = (self.render_prompt(messages=[{"role": "system", "content": system},
                                                              {"role": "user", "content": text}])
                                 for text in ("Hello there.", "7 + 5 = ?"))
                heads.append(common_start(first, second))
        except Exception as exc:  # a template that refuses system messages (it raises from its own Jinja code)
            logger.info("no prefix cache for %s: its chat template does not render a system prompt (%s)", self.name,
                        exc)
            return []
        return common_start(heads[0][::-1], heads[1][::-1])[::-1]

    def _template_head(self, marker: list[int]) -> list[int]:
        """The head the chat template renders when a request sends no system message (its default system prompt and
        the user-turn marker; empty without a marker): every such request starts with it, so the prefix cache splits
        it off whatever its length."""
        if not marker:
            return []
        try:
            ids = self.render_prompt("Hello there.")
        except Exception as exc:  # a template that insists on a system message (it raises from its own Jinja code)
            logger.info("no template head for %s: its chat template does not render a user message alone (%s)",
                        self.name, exc)
            return []
        length = PrefixCache(marker, max_entries=1).head_length(ids)
        return ids[:length]

    def _prefill_head(self, prompt_ids: list[int], plan: ExecutionPlan, ledger: ExecutionLedger, cache: Any,
                      run: Callable[[Callable[[], Any]], Any] | None = None) -> int:
        """Put the prompt's head's keys and values (prunewatch.engine.prefix_cache) in the empty `cache`, copied from
        the prefix cache or computed (and stored) in pieces of PREFILL_CHUNK positions; returns the positions filled (0:
        the prompt has no head, and its prefill runs whole). Each step goes through `run` (the batcher's stepper,
        one job each, run alone: a long head stalls the decoding requests one piece at a time; default: here): the
        thread count that computes a head is part of its key.

        The head is the store's work, done once per head and cache shape, not the request's: its pieces count in a
        ledger of their own, so a request's counts (and its pruning ratio) are the same whether its head was stored
        or not, as its tokens are. `cached_prompt_tokens` says which it was."""
        prefix = self.prefix_cache
        length = prefix.head_length(prompt_ids)
        if length == 0 or not prefix.supports(cache):
            return 0
        run = run or (lambda fn: fn())
        if not run(functools.partial(self._copy_head, prompt_ids[:length], plan, ledger, cache)):
            for start in range(0, length, PREFILL_CHUNK):
                run(functools.partial(self._compute_head_piece, prompt_ids[:length], start, plan, cache))
        return length

    def _head_key(self, head_ids: list[int], plan: ExecutionPlan) -> tuple[tuple[int, ...], ExecutionPlan, int]:
        """The head's key in the prefix cache, with the plan it runs under: the request's plan without activation
        sparsity (a prefill's products run dense either way, masked or not, so requests whose plans differ only in
        their sparsity targets, as the default's adaptive targets do for nearly every prompt, share it; what shapes
        the cache, bypassed blocks and gated heads, stays), and this thread's intra-op thread count."""
        plan = replace(plan, activation_sparsity=0.0, layer_sparsity=(), output_head_sparsity=0.0,
                       output_head_row_kernel=False)
        return tuple(head_ids), plan, torch.get_num_threads()

    def _copy_head(self, head_ids: list[int], plan: ExecutionPlan, ledger: ExecutionLedger, cache: Any) -> bool:
        """Copy the stored head into `cache`; False when the store does not hold it."""
        entry = self.prefix_cache.lookup(self._head_key(head_ids, plan))
        if entry is None:
            return False
        self.prefix_cache.fill(cache, entry)
        ledger.cached_prompt_tokens += len(head_ids)
        return True

    def _compute_head_piece(self, head_ids: list[int], start: int, plan: ExecutionPlan, cache: Any) -> None:
        """Head positions from `start`, PREFILL_CHUNK at most, into `cache`, in a ledger of their own; the last piece
        stores the head."""
        key = self._head_key(head_ids, plan)
        end = min(start + PREFILL_CHUNK, len(head_ids))
        model: Any = self.loaded.model
        device = self.loaded.device
        with executing(key[1], ExecutionLedger()):
            model(input_ids=torch.tensor([head_ids[start:end]], device=device), cache=cache, use_cache=True,
                  position_ids=torch.arange(start, end, device=device)[None], logits_to_keep=1)
        if end == len(head_ids):
            self.prefix_cache.store(key, cache, end)

    def _prefill_chunk(self, prompt_ids: list[int], start: int, cache: Any) -> tuple[int, torch.Tensor]:
        """Prefill up to PREFILL_CHUNK prompt positions from `start` into `cache` in a packed pass of its own (the
        batcher's chunks run the same pass, with decode rows riding along: prunewatch.engine.batching.packed_pass);
        returns the positions filled so far and the chunk's last row of logits (vocab,)."""
        from prunewatch.engine.batching import packed_pass

        piece = prompt_ids[start:start + PREFILL_CHUNK]
        logits, _ = packed_pass(self.loaded.model, piece, start, cache)
        return start + len(piece), logits[-1]

    def render_prompt(self, prompt: str | None = None, system: str | None = None,
                      messages: Sequence[Mapping[str, str]] | None = None) -> list[int]:
        """Token ids of the prompt, through the model's chat template when it has one."""
        tokenizer: Any = self.loaded.tokenizer
        if messages is None:
            if prompt is None:
                raise InvalidRequestError("a request needs a prompt or messages")
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        else:
            text = "\n\n".join(m["content"] for m in messages) + "\n"
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            raise InvalidRequestError("the prompt is empty after tokenization")
        return list(ids)

    def render_raw(self, prompt: str) -> list[int]:
        """Token ids of a plain-text completion prompt, without the chat template, tokenized as given: no BOS
        or other special token is added (as lm-eval's and OpenAI's clients count a prompt's tokens), so the
        tokens an echo returns are the client's own."""
        tokenizer: Any = self.loaded.tokenizer
        try:
            ids = tokenizer(prompt, add_special_tokens=False).input_ids
        except (TypeError, ValueError, UnicodeError) as exc:
            raise InvalidRequestError(f"the prompt cannot be tokenized: {exc}") from exc
        if not ids:
            raise InvalidRequestError("the prompt is empty after tokenization")
        return list(ids)

    def plan(self, prompt_ids: list[int], sensitivity: float, blacklist: list[int],
             prompt_text: str | None = None) -> tuple[BypassPlan | None, str | None]:
        """The request's bypass plan, or (None, fallback reason) when it must run dense."""
        validate_request(self.num_layers, sensitivity, blacklist)
        if sensitivity == 0.0:
            return None, None
        if self._calibration is None:
            return None, "uncalibrated"
        model: Any = self.loaded.model  # a transformers model (typed as a plain nn.Module)
        embed = model.get_input_embeddings()
        with torch.no_grad():
            direction = mean_token_direction(embed(torch.tensor(prompt_ids, device=self.loaded.device)))
        bypass_plan = plan_bypass(
            self._calibration,
            direction,
            prompt_ids,
            sensitivity=sensitivity,
            influence_budget=self.settings.influence_budget,
            blacklist=blacklist,
            protect_edges=self.settings.protect_edge_layers,
            signal_weights=self.settings.signal_weights,
            memory_pressure=memory_pressure(self.loaded.device),
            head_budget=self.settings.head_budget if self.head_gating is not None else 0.0,
        )
        if self.settings.fallback_on_anomaly and prompt_text is not None:
            tokenizer: Any = self.loaded.tokenizer
            text_tokens = len(tokenizer(prompt_text, add_special_tokens=False).input_ids)
            reason = anomaly_reason(prompt_text, text_tokens, bypass_plan.nearest_domain_similarity,
                                    self.settings.anomaly_limits)
            if reason is not None:
                return None, reason
        return bypass_plan, None

    def execution_plan(self, prompt_ids: list[int], sensitivity: float, blacklist: list[int],
                       prompt_text: str | None = None) -> ExecutionPlan:
        """Everything a request with this prompt would skip (bypass, gated heads, sparsity); dense on fallback."""
        bypass_plan, _ = self.plan(prompt_ids, sensitivity, blacklist, prompt_text=prompt_text)
        return self._with_sparsity(bypass_plan, blacklist) if bypass_plan else ExecutionPlan()

    @overload
    def _decode(self, prompt_ids: list[int], plan: ExecutionPlan, ledger: ExecutionLedger, max_new_tokens: int,
                use_cache: bool, stop_at_eos: bool = ..., compiled: bool | None = ..., logprobs: None = ...,
                score_prompt: bool = ..., batcher: DecodeBatcher | None = ...) -> Iterator[int]: ...

    @overload
    def _decode(self, prompt_ids: list[int], plan: ExecutionPlan, ledger: ExecutionLedger, max_new_tokens: int,
                use_cache: bool, stop_at_eos: bool = ..., compiled: bool | None = ..., *, logprobs: int,
                score_prompt: bool = ..., batcher: DecodeBatcher | None = ...) -> Iterator[Scored]: ...

    @torch.no_grad()
    def _decode(self, prompt_ids: list[int], plan: ExecutionPlan, ledger: ExecutionLedger,
                max_new_tokens: int, use_cache: bool, stop_at_eos: bool = True,
                compiled: bool | None = None, logprobs: int | None = None,
                score_prompt: bool = False, batcher: DecodeBatcher | None = None) -> Iterator[int] | Iterator[Scored]:
        """Greedy decoding under `plan`; yields token ids as they are produced. `compiled`: run decode
        steps as the compiled graph (prunewatch.engine.compiled_decode) where the plan allows; None: per settings.

        `logprobs`: yield each token as `Scored` instead, with the `logprobs` most likely tokens at its step
        (fp32 log-softmax of the step's logits); None computes nothing beyond the argmax. `score_prompt`
        (with `logprobs`): the prefill keeps every row of logits, and the prompt's positions are yielded
        first (`in_prompt`), its first token unscored; with `max_new_tokens` 0 only the prefill runs.
        `batcher`: decode through it (prunewatch.engine.batching), sharing decode steps with its other requests.
        """
        from transformers import DynamicCache

        if batcher is not None and use_cache:
            yield from self._decode_batched(batcher, prompt_ids, plan, ledger, max_new_tokens, stop_at_eos,
                                            logprobs, score_prompt)
            return
        model: Any = self.loaded.model  # a transformers model (typed as a plain nn.Module)
        device = self.loaded.device
        ids = torch.tensor([prompt_ids], device=device)  # (1, T)
        executed_blocks = self._kv_layers_read(plan)
        step = self.compiled_decode(compiled) if use_cache else None
        if step is not None and not step.supports(plan):
            step = None
        # Eager on the CPU, decode steps run as the batcher's do (prunewatch.engine.batching.ragged_decode_step, over
        # a cache reserved for the whole request): a request gets the same sums in process as through `serve`.
        ragged = use_cache and step is None and device.type == "cpu"
        if ragged:
            from prunewatch.engine.batching import install_ragged_attention, ragged_decode_step

            install_ragged_attention(model)
            cache: Any = reserved_cache(model.config, len(prompt_ids) + max(1, max_new_tokens))
        else:
            cache = DynamicCache(config=model.config) if use_cache else None
        if step is None:
            plan = self.eager_step_plan(plan)
        score_prompt = score_prompt and logprobs is not None
        if score_prompt and plan.output_head_sparsity > 0.0:  # every prompt row as the last one is computed
            plan = replace(plan, output_head_row_kernel=True)
        with executing(plan, ledger):
            position = 0
            if use_cache and not score_prompt:
                position = self._prefill_head(prompt_ids, plan, ledger, cache)
            step_ids = ids[:, position:]
            for step_index in range(max(max_new_tokens, 1 if score_prompt else 0)):
                keep = 0 if score_prompt and step_index == 0 else 1  # 0: every row (transformers' logits_to_keep)
                if use_cache:
                    positions = torch.arange(position, position + step_ids.shape[1], device=device)[None]
                    logits = None  # (1, rows kept, V)
                    if step is not None and step_ids.shape[1] == 1:
                        out = step.step(plan, ledger, input_ids=step_ids, cache=cache, use_cache=True,
                                        position_ids=positions, logits_to_keep=1)
                        step = step if out is not None else None  # it failed to compile: eager from now on
                        logits = None if out is None else out.logits
                    if logits is None and ragged and step_index > 0:
                        logits = ragged_decode_step(model, [int(step_ids[0, 0])], [position], [cache])[:, None]
                    if logits is None and ragged and keep == 1 and step_index == 0:
                        # The prompt in the batcher's chunks and passes (_decode_batched): the bits `serve` gives
                        start, last_row = position, None
                        while start < len(prompt_ids):
                            start, last_row = self._prefill_chunk(prompt_ids, start, cache)
                            if start < len(prompt_ids):  # the last chunk's reads are counted below
                                ledger.kv_bytes_read += int(executed_blocks * start
                                                            * self._kv_bytes_per_token_per_layer)
                        assert last_row is not None  # a cached head is never the whole prompt
                        logits = last_row[None, None]
                    if logits is None:
                        logits = model(input_ids=step_ids, cache=cache, use_cache=True, position_ids=positions,
                                       logits_to_keep=keep).logits
                    position += step_ids.shape[1]
                    context = position
                else:
                    logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
                    context = ids.shape[1]
                ledger.kv_bytes_read += int(executed_blocks * context * self._kv_bytes_per_token_per_layer)
                if ledger.prefill_dense_flops is None:
                    ledger.end_prefill()
                if keep == 0:  # the echoed prompt: row t predicts token t + 1, nothing predicts the first
                    yield Scored(prompt_ids[0], None, in_prompt=True)
                    yield from score_positions(logits[0, :-1], prompt_ids[1:], logprobs or 0, in_prompt=True)
                    if step_index == max_new_tokens:
                        return  # max_new_tokens 0: the prompt scored, nothing generated
                last = logits[0, -1]  # (V,)
                token = int(last.argmax())
                yield token if logprobs is None else score_positions(last[None], [token], logprobs)[0]
                if stop_at_eos and token in self._eos_ids:
                    return
                step_ids = torch.tensor([[token]], device=device)
                ids = torch.cat([ids, step_ids], dim=1)

    def eager_step_plan(self, plan: ExecutionPlan) -> ExecutionPlan:
        """The plan an eager decode step of this engine runs for `plan`. On the CPU its dense products go through
        the row-invariant products (ExecutionPlan.row_invariant; fp32: csrc/fp32_dense.cpp), as batched steps' must:
        a request then decodes the same tokens in process as through `serve`, and at 2 threads those few-row
        products are faster than BLAS's parallel ones (README "Dense steps through the kernel"). Elsewhere `plan`
        itself."""
        return replace(plan, row_invariant=True) if self.loaded.device.type == "cpu" else plan

    @torch.no_grad()
    def _decode_batched(self, batcher: DecodeBatcher, prompt_ids: list[int], plan: ExecutionPlan,
                        ledger: ExecutionLedger, max_new_tokens: int, stop_at_eos: bool, logprobs: int | None,
                        score_prompt: bool) -> Iterator[int] | Iterator[Scored]:
        """`_decode` through the batcher: the prefill in chunks on its stepper (in one piece when every prompt row's
        logits are kept), then each decode step shared with the other requests due at the same time."""
        model: Any = self.loaded.model  # a transformers model (typed as a plain nn.Module)
        # Buffers of the request's whole length, the positions its KV reservation counts (prunewatch.engine.kv_cache)
        cache = reserved_cache(model.config, len(prompt_ids) + max(1, max_new_tokens))
        executed_blocks = self._kv_layers_read(plan)
        score_prompt = score_prompt and logprobs is not None
        if score_prompt and plan.output_head_sparsity > 0.0:  # every prompt row as the last one is computed
            plan = replace(plan, output_head_row_kernel=True)
        plan = replace(plan, row_invariant=True)
        chunk = len(prompt_ids) if score_prompt else PREFILL_CHUNK
        with executing(plan, ledger), batcher.sequence(plan, ledger, cache,
                                                       kv_tokens=len(prompt_ids) + max_new_tokens) as sequence:
            logits = None
            start = 0 if score_prompt else self._prefill_head(prompt_ids, plan, ledger, cache, run=sequence.run)
            while start < len(prompt_ids):  # one pass on the stepper per chunk, the due decode rows along
                logits = sequence.prefill(prompt_ids[start:start + chunk], start, keep_all=score_prompt)
                start = min(start + chunk, len(prompt_ids))
                ledger.kv_bytes_read += int(executed_blocks * start * self._kv_bytes_per_token_per_layer)
            assert logits is not None  # the prompt is never empty
            ledger.end_prefill()
            if score_prompt:
                yield Scored(prompt_ids[0], None, in_prompt=True)
                yield from score_positions(logits[:-1], prompt_ids[1:], logprobs or 0, in_prompt=True)
                if max_new_tokens == 0:
                    return
            last = logits[-1]
            position = len(prompt_ids)
            token = -1
            for step_index in range(max_new_tokens):
                if step_index > 0:
                    last = sequence.step(token, position)
                    position += 1
                    ledger.kv_bytes_read += int(executed_blocks * position * self._kv_bytes_per_token_per_layer)
                token = int(last.argmax())
                yield token if logprobs is None else score_positions(last[None], [token], logprobs)[0]
                if stop_at_eos and token in self._eos_ids:
                    return

    @property
    def vocab_size(self) -> int:
        """Token ids this model can read: the rows of its input embedding."""
        model: Any = self.loaded.model  # a transformers model (typed as a plain nn.Module)
        return int(model.get_input_embeddings().num_embeddings)

    def decode_prompt(self, prompt_ids: Sequence[int]) -> str:
        """The text of a prompt given as token ids (special tokens left out), for the anomaly checks."""
        tokenizer: Any = self.loaded.tokenizer
        return tokenizer.decode(list(prompt_ids), skip_special_tokens=True)

    @property
    def context_window(self) -> int | None:
        """Positions the model was built for (config.max_position_embeddings, or n_positions for GPT-2);
        None when its config names none."""
        model: Any = self.loaded.model  # a transformers model (typed as a plain nn.Module)
        config = model.config
        for name in ("max_position_embeddings", "n_positions"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def compiled_decode(self, wanted: bool | None = None) -> CompiledDecode | None:
        """The compiled decode step (prunewatch.engine.compiled_decode) when `wanted` (None: the `compile_decode`
        setting) and the model is on the CPU, built for the wrappers installed now; None otherwise or once
        its compilation failed."""
        wanted = self.settings.compile_decode if wanted is None else wanted
        if not wanted or self.loaded.device.type != "cpu":
            return None
        layers: list[SparseLinear] = list(self._sparsity.layers.values()) if self._sparsity is not None else []
        compiled = self._compiled
        if compiled is None or compiled.layers != layers or compiled.output_head is not self._output_head:
            from prunewatch.engine.compiled_decode import CompiledDecode

            compiled = self._compiled = CompiledDecode(self.instrumented, layers, self._output_head)
        return compiled if compiled.enabled else None

    @property
    def compiled_decode_failure(self) -> str | None:
        """Why compiled decoding was turned off for this engine (the compiler's error), None while it was not."""
        return self._compiled.failure if self._compiled is not None else None

    def warm_up_compiled(self, prompt: str = "Warm up the compiled decode step.") -> float | None:
        """Compile the decode graphs requests use most (dense, and the default plan's for `prompt`) before
        serving, so no request waits for a compiler; seconds taken, None when compiled decode is off,
        including when compiling failed during the warm-up (the engine then decodes eagerly)."""
        if self.compiled_decode() is None:
            return None
        started = time.perf_counter()
        ids = self.render_prompt(prompt)
        default = self.execution_plan(ids, self.settings.sensitivity, list(self.settings.layer_blacklist),
                                      prompt_text=prompt)
        for plan in (ExecutionPlan(), default):
            self.measure_decode(ids, plan, 3)
        return time.perf_counter() - started if self.compiled_decode() is not None else None

    def measure_decode(self, prompt_ids: Sequence[int], plan: ExecutionPlan, new_tokens: int,
                       compiled: bool | None = None, batcher: DecodeBatcher | None = None) -> DecodeMeasurement:
        """Greedy-decode exactly `new_tokens` tokens under `plan` (end of sequence does not stop it, as
        vLLM's ignore_eos), for benchmarks: the decode loop of every request, without tokenizing,
        streaming text or stats; timed from the first generated token to the last. `compiled`: decode
        steps as the compiled graph, or eagerly (None: the `compile_decode` setting); `batcher`: through it,
        sharing decode steps with whatever else it runs."""
        if new_tokens < 2:
            raise InvalidRequestError(f"measuring decode needs at least 2 new tokens, got {new_tokens}")
        ledger = ExecutionLedger()
        tokens: list[int] = []
        first_at = 0.0
        for token in self._decode(list(prompt_ids), plan, ledger, new_tokens, use_cache=True, stop_at_eos=False,
                                  compiled=compiled, batcher=batcher):
            tokens.append(token)
            if len(tokens) == 1:
                first_at = time.perf_counter()
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize(self.loaded.device)
        return DecodeMeasurement(tokens=tokens, decode_s=time.perf_counter() - first_at, ledger=ledger)

    def stream(
        self,
        prompt: str | None = None,
        *,
        system: str | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        max_new_tokens: int | None = None,
        sensitivity: float | None = None,
        layer_blacklist: Sequence[int] | None = None,
        log_level: LogLevel | None = None,
        quality: bool | str = False,
        use_cache: bool = True,
        request_id: str | None = None,
        prompt_ids: Sequence[int] | None = None,
        stop: Sequence[str] = (),
        logprobs: int | None = None,
        echo: bool = False,
        batcher: DecodeBatcher | None = None,
    ) -> Iterator[TokenDelta | GenerationResult]:
        """Yield TokenDelta pieces as tokens are produced, then the GenerationResult.

        `prompt_ids`, when given, are the already rendered prompt (a caller that tokenized it to
        check limits, or a raw completion prompt from `render_raw`); `prompt`/`messages` then only
        feed the anomaly checks. `stop`: strings that end the completion where one first appears in the
        generated text, which is cut before it (finish_reason "stop"); while streaming, the last
        len(longest stop) - 1 characters wait until they cannot begin one. `quality`: "on" (or True) scores the
        served answer against the dense model in one teacher-forced pass; "full" also generates the dense answer
        for the continuation figures and the divergence (engine.quality); the time is `quality_ms`, apart.

        `logprobs` (0..MAX_TOP_LOGPROBS): every generated token's log-probability under this request's plan,
        with that many most likely alternatives, in the pieces and the result (end of sequence included;
        tokens from where a stop sequence begins left out, as their text is). None computes none.
        `echo`: the prompt's text comes first (a TokenDelta with `echo`, and the result's `prompt_text`)
        and, with `logprobs`, its tokens' log-probabilities from the prefill's own forward pass (the
        first token's is None); `max_new_tokens` may then be 0, which scores the prompt only.
        `batcher` (PruningEngine.new_batcher): every forward pass of the request, its quality check's included, runs
        on the batcher's stepper, its decode steps shared with the batcher's other requests.
        """
        started = time.perf_counter()
        request = self._stream_request(
            prompt, system=system, messages=messages, max_new_tokens=max_new_tokens, sensitivity=sensitivity,
            layer_blacklist=layer_blacklist, log_level=log_level, quality=quality, use_cache=use_cache,
            request_id=request_id, prompt_ids=prompt_ids, stop=stop, logprobs=logprobs, echo=echo)
        bypass_plan, fallback = self.plan(request.prompt_ids, request.sensitivity, request.blacklist,
                                          prompt_text=request.user_text)
        plan = self._with_sparsity(bypass_plan, request.blacklist) if bypass_plan else ExecutionPlan()
        preprocessed = time.perf_counter()

        ledger = ExecutionLedger()
        growing = CompletionText(self.loaded.tokenizer, self.token_texts, request.stops, self._eos_ids)
        prompt_echo = PromptEcho(request.prompt_ids, self.token_texts)
        if request.echo and request.logprobs is None:
            yield TokenDelta(*prompt_echo.plain(self.loaded.tokenizer), echo=True)
        with PeakMemory(self.loaded.device) as memory:
            yield from self._stream_pieces(request, plan, ledger, growing, prompt_echo, batcher)
            if self.loaded.device.type == "cuda":
                torch.cuda.synchronize(self.loaded.device)
            inferred = time.perf_counter()
            completion = growing.finish()
            if completion.rest is not None:
                yield TokenDelta(*completion.rest)
            served_ids = self._served_ids(completion.tokens, completion.text, completion.stopped_at)
            report, quality_s = self._check_quality(request, plan, completion, served_ids, batcher)
            peak = memory.peak_bytes()
        stats = self._request_stats(
            request, bypass_plan=bypass_plan, fallback=fallback, plan=plan, ledger=ledger, completion=completion,
            report=report, peak_memory_bytes=peak, peak_memory_source=memory.source,
            times=RequestTimes(started, preprocessed, growing.first_token_at, inferred))
        self._log(stats, bypass_plan, request.log_level)
        stats.quality_ms = _ms(quality_s)
        stats.postprocessing_ms = _ms(time.perf_counter() - inferred - quality_s)
        yield GenerationResult(text=completion.text, token_ids=completion.tokens, stats=stats, served_ids=served_ids,
                               logprobs=completion.logprobs if request.logprobs is not None else None,
                               prompt_logprobs=prompt_echo.logprobs, prompt_text=prompt_echo.text)

    def _stream_request(
        self,
        prompt: str | None,
        *,
        system: str | None,
        messages: Sequence[Mapping[str, str]] | None,
        max_new_tokens: int | None,
        sensitivity: float | None,
        layer_blacklist: Sequence[int] | None,
        log_level: LogLevel | None,
        quality: bool | str,
        use_cache: bool,
        request_id: str | None,
        prompt_ids: Sequence[int] | None,
        stop: Sequence[str],
        logprobs: int | None,
        echo: bool,
    ) -> StreamRequest:
        """stream()'s arguments checked (InvalidRequestError), defaults from the settings, and the prompt rendered."""
        sensitivity = self.settings.sensitivity if sensitivity is None else float(sensitivity)
        blacklist = sorted(set(self.settings.layer_blacklist if layer_blacklist is None else layer_blacklist))
        log_level = self.settings.log_level if log_level is None else LogLevel(log_level)
        max_new_tokens = self.settings.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        least = 0 if echo else 1  # 0 new tokens only scores an echoed prompt
        if max_new_tokens < least:
            raise InvalidRequestError(f"max_new_tokens must be >= {least}, got {max_new_tokens}")
        if logprobs is not None and not 0 <= int(logprobs) <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be within 0..{MAX_TOP_LOGPROBS}, got {logprobs}")
        stops = stop_sequences(stop)
        check = quality_check(quality)
        request_id = request_id or uuid.uuid4().hex
        ids = list(prompt_ids) if prompt_ids is not None else self.render_prompt(prompt, system, messages)
        if not ids:
            raise InvalidRequestError("the prompt is empty after tokenization")
        window = self.context_window
        if window is not None and len(ids) + max_new_tokens > window:  # past it a model decodes garbage
            raise InvalidRequestError(f"this model's context is {window} tokens; the prompt's {len(ids)} "
                                      f"plus {max_new_tokens} new tokens do not fit")
        user_text = prompt if messages is None else "\n".join(m.get("content", "") for m in messages if m.get("role") == "user")
        return StreamRequest(request_id=request_id, prompt_ids=ids, user_text=user_text, max_new_tokens=max_new_tokens,
                             sensitivity=sensitivity, blacklist=blacklist, log_level=log_level, check=check, stops=stops,
                             logprobs=logprobs, echo=echo, use_cache=use_cache)

    def _stream_pieces(self, request: StreamRequest, plan: ExecutionPlan, ledger: ExecutionLedger,
                       growing: CompletionText, prompt_echo: PromptEcho,
                       batcher: DecodeBatcher | None = None) -> Iterator[TokenDelta]:
        """The decode loop of a request: each token into the growing completion, and the pieces ready to go out
        (with echo and logprobs, first the prompt's, once the prefill scored all of it); stops at the end of
        sequence, a stop sequence or the length."""
        for item in self._decode(request.prompt_ids, plan, ledger, request.max_new_tokens, request.use_cache,
                                 logprobs=request.logprobs, score_prompt=request.echo, batcher=batcher):
            if isinstance(item, Scored):
                if item.in_prompt:
                    echoed = prompt_echo.add(item)
                    if echoed is not None:
                        yield TokenDelta(*echoed, echo=True)
                    continue
                piece = growing.add(item.token_id, item)
            else:
                piece = growing.add(item)
            if growing.ended:
                break
            if piece is not None:
                yield TokenDelta(*piece)

    def _check_quality(self, request: StreamRequest, plan: ExecutionPlan, completion: Completion,
                       served_ids: list[int], batcher: DecodeBatcher | None = None) -> tuple[QualityReport | None, float]:
        """(the request's quality report, seconds it took): none when its check is off; "full" also generates the
        dense answer for the continuation figures and the divergence."""
        if request.check == "off":  # its own figure: the scoring is not part of this request's postprocessing
            return None, 0.0
        quality_started = time.perf_counter()
        dense = None
        if request.check == "full":
            # A stop sequence ended the answer where its text did: the dense reference is generated over
            # as many tokens, not over the text the client never received.
            reference_tokens = len(completion.tokens) if completion.stopped_at >= 0 else request.max_new_tokens
            dense = (list(self._decode(request.prompt_ids, ExecutionPlan(), ExecutionLedger(), reference_tokens, True,
                                       batcher=batcher))
                     if plan.skips_work else completion.tokens)
        def score() -> QualityReport | None:
            return quality_report(self.instrumented, request.prompt_ids, served_ids, plan, self.loaded.device, dense)

        # Batching: the teacher-forced pass runs on the stepper too, between decode steps, not beside them.
        report = batcher.run(score) if batcher is not None else score()
        if report is not None and dense is not None:  # where the served text leaves the dense text
            report = replace(report, divergence_at=divergence(
                served_ids, [t for t in dense if t not in self._eos_ids]))
        return report, time.perf_counter() - quality_started

    def _request_stats(self, request: StreamRequest, *, bypass_plan: BypassPlan | None, fallback: str | None,
                       plan: ExecutionPlan, ledger: ExecutionLedger, completion: Completion,
                       report: QualityReport | None, peak_memory_bytes: int, peak_memory_source: str,
                       times: RequestTimes) -> RequestStats:
        """The request's statistics; postprocessing_ms and quality_ms are filled in by the caller, last."""
        tokens = len(completion.tokens)
        inference_s = times.inferred - times.preprocessed
        dram_value, dram_source = self._dram_figure(plan, ledger)
        decode_s = times.inferred - times.first_token_at if times.first_token_at else 0.0
        return RequestStats(
            request_id=request.request_id,
            model=self.name,
            device=self.loaded.device.type,
            dtype=str(self.loaded.dtype).replace("torch.", ""),
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=tokens,
            preprocessing_ms=_ms(times.preprocessed - times.started),
            inference_ms=_ms(inference_s),
            postprocessing_ms=0.0,
            ttft_ms=_ms((times.first_token_at or times.inferred) - times.started),
            decode_tokens_per_s=round((tokens - 1) / decode_s, 3) if tokens > 1 and decode_s > 0 else 0.0,
            tokens_per_s=round(tokens / inference_s, 3) if inference_s > 0 else 0.0,
            sensitivity=request.sensitivity,
            pruning_ratio=round(ledger.pruning_ratio, 6),
            prefill_pruning_ratio=round(ledger.prefill_pruning_ratio, 6),
            decode_pruning_ratio=round(ledger.decode_pruning_ratio, 6),
            executed_flops=ledger.executed_flops,
            dense_flops=ledger.dense_flops,
            layers_bypassed=sorted(plan.bypass),
            layers_total=self.num_layers,
            heads_gated=plan.heads_gated,
            activation_sparsity=round(ledger.activation_sparsity, 6),
            domain=bypass_plan.domain if bypass_plan else None,
            domain_confidence=round(bypass_plan.domain_confidence, 4) if bypass_plan else 0.0,
            fallback_reason=fallback,
            effective_sensitivity=round(bypass_plan.signals.effective_sensitivity, 4) if bypass_plan else 0.0,
            signals=bypass_plan.signals.as_dict() if bypass_plan else None,
            quality_flags=self._quality_flags(ledger.pruning_ratio, report),
            quality=report,
            peak_memory_bytes=peak_memory_bytes,
            peak_memory_source=peak_memory_source,
            dram_bytes_per_instruction=dram_value,
            dram_source=dram_source,
            finish_reason=completion.finish_reason,
            mean_batch_size=round(ledger.mean_batch_size, 3),
            cached_prompt_tokens=ledger.cached_prompt_tokens,
        )

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Run one request to completion; see `stream` for the parameters."""
        result = None
        for item in self.stream(prompt, **kwargs):
            result = item
        if not isinstance(result, GenerationResult):  # stream always ends with its result
            raise RuntimeError("generation ended without a result")
        return result

    def _load_dram_profile(self, path: Path | None) -> DramProfile | None:
        """The ncu profile for this model on this device; a profile of another GPU is not used."""
        if path is None:
            return None
        profile = DramProfile.load(path)
        profile.check(self.loaded.fingerprint)
        here = device_name(self.loaded.device)
        if not profile.matches_device(here):
            logger.warning("DRAM profile %s was measured on %s, not on %s: requests report the estimate",
                           path, profile.device_name, here)
            return None
        return profile

    def _dram_figure(self, plan: ExecutionPlan, ledger: ExecutionLedger) -> tuple[float | None, str]:
        """(DRAM bytes per instruction, source): ncu when the profile holds this request's decode-step shape
        (matched on the decode steps' sparsity: the dense prefill would pull a sparse request towards the
        dense profile); else the CPU model-level estimate on a CPU. On a GPU that estimate's instruction
        count (FLOPs / AVX2 FMA width) does not hold, so without a matching profile there is no figure."""
        if self.dram_profile is not None and not plan.bypass and plan.heads_gated == 0:
            level = self.dram_profile.level_for(ledger.decode_activation_sparsity)
            if level is not None:
                return level.bytes_per_instruction, "ncu"
        if self.loaded.device.type != "cpu":
            return None, "unavailable"
        return estimate_dram_bytes_per_instruction(
            ledger.weight_bytes_read, ledger.kv_bytes_read, ledger.executed_flops), "estimate"

    def _kv_layers_read(self, plan: ExecutionPlan) -> float:
        """Blocks whose KV cache a decode step reads, in whole-layer units: a bypassed block reads none,
        a block with gated key/value heads reads only its kept ones."""
        if self.head_gating is None or not plan.gated_heads:
            return float(self.num_layers - len(plan.bypass))
        shape = self.head_gating.shape
        return sum(len(shape.kept_kv_heads(plan.heads_gated_in(i))) / shape.kv_heads
                   for i in range(self.num_layers) if i not in plan.bypass)

    def _with_sparsity(self, bypass_plan: BypassPlan, blacklist: list[int]) -> ExecutionPlan:
        """Add the request's activation-sparsity target (sensitivity-scaled; blacklisted and transition
        layers keep dense inputs) and its output-head target (prunewatch.engine.settings.output_head_target; with
        quantized weights from quantized_output_head_sparsity) to its bypass plan."""
        effective = bypass_plan.signals.effective_sensitivity
        plan = bypass_plan.plan
        head_setting = (self.settings.output_head_sparsity if self.settings.weights == "fp32"
                        else self.settings.quantized_output_head_sparsity)
        head_target = output_head_target(head_setting, effective)
        if self._output_head is not None and head_target > 0.0:
            plan = replace(plan, output_head_sparsity=round(head_target, 4),
                           output_head_candidates=self.settings.output_head_candidates)
        target = self.settings.activation_sparsity * effective
        if self._sparsity is None or target <= 0.0:
            return plan
        keep_dense = set(blacklist) | set(bypass_plan.signals.transition_layers)
        per_layer = tuple(0.0 if i in keep_dense else round(target, 4) for i in range(self.num_layers))
        return replace(plan, layer_sparsity=per_layer,
                       family_scale=tuple(sorted(self.settings.sparsity_family_scale.items())))

    def answer_logprobs(self, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> tuple[list[bool], list[float]]:
        """An answer (from this engine or any other with the same tokenizer) scored by this model run dense, in one
        teacher-forced pass: per token, whether it is the argmax, and its log-probability (engine.quality). The
        collector's in-process reference calls it."""
        return answer_token_scores(self.instrumented.model, prompt_ids, answer_ids, self.loaded.device)

    def reference_answer(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """This model's own greedy answer, dense, ended by end of sequence (left out) or the length."""
        tokens = list(self._decode(list(prompt_ids), ExecutionPlan(), ExecutionLedger(), max_new_tokens, True))
        return [t for t in tokens if t not in self._eos_ids]

    def _served_ids(self, tokens: list[int], text: str, stopped_at: int) -> list[int]:
        """The answer's tokens as the client received them: end of sequence left out, and an answer cut by a
        stop sequence re-tokenized from its text (the tokens past the cut were never served)."""
        if stopped_at >= 0:
            tokenizer: Any = self.loaded.tokenizer
            return list(tokenizer(text, add_special_tokens=False).input_ids) if text else []
        return [t for t in tokens if t not in self._eos_ids]

    def _quality_flags(self, ratio: float, report: QualityReport | None) -> list[str]:
        flags = []
        if ratio > self.settings.ratio_red_line:
            flags.append("ratio_above_red_line")
        if report is not None and report.reference_agreement < self.settings.agreement_floor:
            flags.append("agreement_below_floor")
        return flags

    def _log(self, stats: RequestStats, bypass_plan: BypassPlan | None, level: LogLevel) -> None:
        if level == LogLevel.NONE:
            return
        logger.info(
            "request %s model=%s domain=%s layers_bypassed=%s heads_gated=%d activation_sparsity=%.4f "
            "ratio=%.4f tokens=%d fallback=%s",
            stats.request_id, stats.model, stats.domain, stats.layers_bypassed, stats.heads_gated,
            stats.activation_sparsity, stats.pruning_ratio, stats.completion_tokens, stats.fallback_reason,
        )
        if level == LogLevel.DETAILED and bypass_plan is not None:
            logger.info("request %s signals %s", stats.request_id, bypass_plan.signals.as_dict())
            for d in bypass_plan.decisions:
                logger.info(
                    "request %s layer=%d influence=%.5f threshold=%.5f decision=%s heads_gated=%s",
                    stats.request_id, d.layer, d.influence, d.threshold, d.decision, list(d.heads_gated),
                )
