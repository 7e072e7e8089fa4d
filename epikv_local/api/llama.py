"""``epikv_local.Llama``: llama-cpp-python's ``Llama`` for chat scripts, with a KV budget.

A script written against ``llama_cpp.Llama`` changes its import line (and may add ``kv_budget=``)::

    from epikv_local import Llama
    llm = Llama(model_path="model.gguf", kv_budget=4096)
    for chunk in llm.create_chat_completion(messages=[...], stream=True): ...

The names mean what they mean in llama-cpp-python; the differences are listed in docs/api.md. Internally
one :class:`~epikv_local.engine.session.Session` holds one sequence whose live KV cells never exceed
``kv_budget``: every call keeps the longest common token prefix with what the cache holds (evictions and
all) and decodes only the rest, so a multi-turn chat runs on one cache. Prompts are rendered by
llama-cpp-python's own chat handlers (the GGUF's Jinja template, or a named ``chat_format``), which also build
the grammars of ``response_format`` and ``tools`` and shape logprobs and tool calls (:mod:`.chat_call`);
reasoning (``<think>…</think>``) is split into ``reasoning_content`` (``reasoning_format="deepseek"``,
llama-server's default) and can be given a token budget (``reasoning_budget``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator

import jinja2

from ..engine.budget import DEFAULT_KV_BUDGET
from ..engine.handles import Closing, Model
from ..engine.native import load
from ..engine.sampling import MAX_SEED, SamplingConfig
from ..engine.session import Session
from ..errors import ConfigError, EpikvError, utf8
from ..policies import DEFAULT_POLICY
from . import hub, responses
from .chat import flatten_text_parts, message_problem
from .chat_call import HandlerCall, chat_arguments, chat_steps, split_message
from .completion import chained, check_budget, completion_chunks, fim_prompt
from .generation import ReasoningBudget, stream_generate
from .llama_extras import LlamaExtras
from .logprobs import CompletionLogprobs
from .lowlevel import grammar_text
from .reasoning import CLOSE, FORMATS, prompt_opens_thinking
from .responses import ChunkStep, extension  # noqa: F401  (extension: this module's name for it, kept)
from .session_spec import resolve_session
from .slots import Slots, fan_out, fan_out_steps
from .streams import Stream, primed

#: sampling defaults for reasoning models (DeepSeek-R1 / Qwen3 model cards) when the caller sets none
REASONING_TEMPERATURE, REASONING_TOP_P = 0.6, 0.95
#: llama.cpp's "pick a random seed"
LLAMA_DEFAULT_SEED = MAX_SEED
#: llama-cpp-python's default ``last_n_tokens_size``: the tokens its penalties look back over
LAST_N_TOKENS_SIZE = 64
#: llama-cpp-python constructor arguments without effect here, with llama-cpp-python's defaults: accepted, and a
#: warning names those set to something else (they tune memory, threads or devices, not what is computed)
IGNORED_ARGS = {
    "use_mmap": True, "use_mlock": False, "main_gpu": 0, "split_mode": 1, "tensor_split": None, "n_ubatch": 512,
    "n_threads_batch": None, "logits_all": False, "embedding": False, "offload_kqv": True, "op_offload": None,
    "swa_full": None, "no_perf": False, "numa": False, "draft_model": None, "mul_mat_q": True,
    "defrag_thold": -1.0, "f16_kv": True}
#: ignored without a warning: logprobs need no ``logits_all`` here, embeddings no ``embedding=True``
QUIET_ARGS = frozenset({"n_threads_batch", "logits_all", "embedding"})
#: llama-cpp-python constructor arguments that would change what the model computes: refused (ConfigError)
#: unless left at llama-cpp-python's default, which means "the model's own"
REFUSED_ARGS = {
    "vocab_only": False, "kv_overrides": None, "rope_scaling_type": -1, "attention_type": -1, "rope_freq_base": 0.0,
    "rope_freq_scale": 0.0, "yarn_ext_factor": -1.0, "yarn_attn_factor": 1.0, "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0, "yarn_orig_ctx": 0, "lora_base": None, "lora_scale": 1.0, "lora_path": None,
    "tokenizer": None}
#: chat roles accepted in messages
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def check_messages(messages) -> None:
    """ConfigError unless ``messages`` is a non-empty list of {"role": known role, "content": ...} dicts."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConfigError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConfigError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ConfigError(f"messages[{i}] has unknown role {role!r}; roles are {', '.join(ROLES)}")
        problem = message_problem(m)
        if problem:
            raise ConfigError(f"messages[{i}].{problem[0]} {problem[1]}")


class Llama(LlamaExtras, Closing):
    """A GGUF model with one budgeted KV cache, shaped like ``llama_cpp.Llama`` (see docs/api.md).

    kv_budget: live KV cells (tokens) kept; beyond it the policy evicts. Default: ``n_ctx`` when given,
        else 4096. ``n_ctx`` is not a length limit here: a generation runs until its end or ``max_tokens``.
    kv_policy / kv_policy_settings: the eviction policy and its settings (``epikv_local.policies``); a
        calibratable policy takes the model's calibration when no settings are given.
    n_sink, n_recent, recent_fraction, protect_prompt, evict_chunk: the budget settings (``BudgetConfig``).
    n_gpu_layers: layers offloaded to a GPU backend; -1 (default) = all of them on a GPU build (CPU builds
        ignore it).
    flash_attn: on by default (attention-free eviction keeps it on; the attention-based policies need it off).
    reasoning_format: "deepseek" (split ``<think>`` into ``reasoning_content``) or "none".
    reasoning_budget: tokens a call may generate inside an open ``<think>`` block before ``</think>`` is forced
        (-1, the default: unlimited; 0: close it at once); a call's ``reasoning_budget=`` overrides it.
    last_n_tokens_size: tokens the repeat / frequency / presence penalties look back over (llama-cpp-python's).
    spm_infill: with ``suffix``, put the suffix before the prefix (llama-cpp-python's).
    rpc_servers: ``"host:port,host:port"`` of llama.cpp ``rpc-server`` processes to offload layers to (docs/rpc.md).
    max_prompt_tokens: refuse (ConfigError) a call whose prompt has more tokens, before any of it is decoded
        (None: no limit; a server sets one so that no request can hold the model for a day of prefill).
    """

    def __init__(self, model_path: str | os.PathLike, *, n_gpu_layers: int = -1, n_ctx: int | None = None,
                 n_batch: int = 64, n_threads: int | None = None, seed: int = LLAMA_DEFAULT_SEED,
                 flash_attn: bool = True, type_k=None, type_v=None, chat_format: str | None = None,
                 chat_handler=None, verbose: bool = False, kv_budget: int | None = None, kv_policy: str = DEFAULT_POLICY,
                 kv_policy_settings: dict | None = None, n_sink: int = 4, n_recent: int | None = None,
                 recent_fraction: float | None = None, protect_prompt: bool = True, evict_chunk: int = 16,
                 reasoning_format: str = "deepseek", reasoning_budget: int = -1, capture_route: str = "layer_out",
                 rpc_servers: str | list[str] | None = None, max_prompt_tokens: int | None = None,
                 last_n_tokens_size: int = LAST_N_TOKENS_SIZE, spm_infill: bool = False,
                 pooling_type: int | str | None = None, n_parallel: int = 1, **kwargs: Any):
        unknown = sorted(set(kwargs) - set(IGNORED_ARGS) - set(REFUSED_ARGS))
        if unknown:
            raise TypeError(f"Llama() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
        changed = {k for k, v in kwargs.items() if v is not None and v != {**IGNORED_ARGS, **REFUSED_ARGS}[k]
                   and not (k == "kv_overrides" and not v)}
        refused = sorted(changed & set(REFUSED_ARGS))
        if refused:
            raise ConfigError(f"epikv_local.Llama does not support {', '.join(refused)}: they change what the model "
                              "computes (LoRA, RoPE / YaRN scaling, attention type, metadata overrides, another "
                              "tokenizer, a vocabulary without weights); leave them at llama-cpp-python's defaults "
                              "(see docs/api.md)")
        ignored = sorted(changed - QUIET_ARGS)
        if ignored:
            warnings.warn(f"epikv_local.Llama ignores {', '.join(ignored)} (see docs/api.md)", stacklevel=2)
        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 0):
            raise ConfigError(f"n_ctx must be an integer >= 0, got {n_ctx!r}")
        if kv_budget is None:
            kv_budget = n_ctx if n_ctx else DEFAULT_KV_BUDGET
        elif n_ctx and n_ctx != kv_budget:
            warnings.warn(f"n_ctx={n_ctx} is not used: epikv-local keeps at most kv_budget={kv_budget} KV cells and "
                          "evicts beyond them, so the context size does not limit a generation", stacklevel=2)
        if reasoning_format not in FORMATS:
            raise ConfigError(f"reasoning_format must be one of {FORMATS}, got {reasoning_format!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise ConfigError(f"seed must be an integer in 0..{MAX_SEED}, got {seed!r}")
        if max_prompt_tokens is not None and (isinstance(max_prompt_tokens, bool) or not isinstance(
                max_prompt_tokens, int) or max_prompt_tokens < 1):
            raise ConfigError(f"max_prompt_tokens must be an integer >= 1 or None, got {max_prompt_tokens!r}")
        if isinstance(last_n_tokens_size, bool) or not isinstance(last_n_tokens_size, int) or last_n_tokens_size < -1:
            raise ConfigError(f"last_n_tokens_size must be an integer >= -1 (-1: all), got {last_n_tokens_size!r}")
        if isinstance(n_parallel, bool) or not isinstance(n_parallel, int) or not 1 <= n_parallel <= 256:
            raise ConfigError(f"n_parallel must be an integer in 1..256, got {n_parallel!r}")
        self.n_parallel = n_parallel
        if pooling_type is not None:
            from .embeddings import pooling_type as check_pooling

            check_pooling(pooling_type)
            self.embedding_pooling_type = pooling_type
        self.max_prompt_tokens = max_prompt_tokens
        self.model_path = str(model_path)
        self.verbose = verbose
        self.seed = seed
        self.reasoning_format = reasoning_format
        self.reasoning_budget = check_budget(reasoning_budget)
        self.last_n_tokens_size = last_n_tokens_size
        self.spm_infill = bool(spm_infill)
        self._lock = threading.Lock()
        self._generation = 0  # bumped by every call: an older stream still being read is superseded
        self._active = None  # the stream a newer call supersedes (streams.Stream, or a generate() generator)
        self._think_close: tuple[int, ...] | None = None  # the tokens of "</think>", tokenized on first use
        spec = resolve_session(
            model_path, kv_budget=kv_budget, kv_policy=kv_policy, kv_policy_settings=kv_policy_settings,
            n_sink=n_sink, n_recent=n_recent, recent_fraction=recent_fraction, protect_prompt=protect_prompt,
            evict_chunk=evict_chunk, n_batch=n_batch, n_threads=n_threads, flash_attn=flash_attn,
            capture_route=capture_route, type_k=type_k, type_v=type_v)
        self.calibration = spec.calibration
        with contextlib.ExitStack() as stack:
            nat = load(verbose=verbose)
            self._model = stack.enter_context(Model(model_path, n_gpu_layers=n_gpu_layers, native=nat,
                                                    rpc_servers=rpc_servers))
            self._slots = None
            if n_parallel == 1:
                self._session = stack.enter_context(spec.open(self._model))
            else:  # one context, n_parallel sequences decoded together; each call leases one (api/slots.py)
                pool = stack.enter_context(spec.open_pool(self._model, n_parallel))
                self._session = pool.open()
                self._slots = Slots(pool, self._session)
            self._stack = stack.pop_all()
        if max_prompt_tokens is not None:
            self._model.max_piece_bytes()  # once, now rather than in the first request
        self.chat_format, self.chat_handler = self._chat_handler(chat_format, chat_handler)

    def choice_steps(self, n: int, steps_method, **kwargs) -> Iterator[ChunkStep]:
        """``n`` streams of ``steps_method`` (``completion_steps`` or ``chat_completion_steps``) with
        ``kwargs``, merged as OpenAI streams ``n`` choices (each chunk's choice has its ``index``; choice i uses
        seed + i); each step's statistics count all choices' tokens. With ``n_parallel`` >= n the choices share
        the prompt's cells and decode together (see :meth:`create_completion`)."""
        n = self._n_choices(n)
        seed = kwargs.pop("seed", None)
        return fan_out_steps(n, lambda i: steps_method(**kwargs, seed=self._choice_seed(seed, i)), self._slots)

    def _choice_seed(self, seed: int | None, i: int) -> int | None:
        """Choice i's seed: the call's (or the Llama's fixed) seed + i; None (a random seed per call) stays."""
        seed = self.seed if seed is None else seed
        return None if seed == LLAMA_DEFAULT_SEED else (seed + i) % MAX_SEED

    @staticmethod
    def _n_choices(n) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 128:
            raise ConfigError(f"n must be an integer in 1..128, got {n!r}")
        return n

    # -- construction helpers ----------------------------------------------------------------------------------
    def _chat_handler(self, chat_format, chat_handler):
        from llama_cpp import llama_chat_format as lcf

        if chat_handler is not None:
            return chat_format, chat_handler
        if chat_format is not None:
            try:
                return chat_format, lcf.get_chat_completion_handler(chat_format)
            except lcf.LlamaChatCompletionHandlerNotFoundException:
                names = sorted(lcf.LlamaChatCompletionHandlerRegistry()._chat_handlers)
                raise ConfigError(f"unknown chat_format {chat_format!r}; choose one of {', '.join(names)}") from None
        template = self._model.meta("tokenizer.chat_template")
        if template:
            fmt = lcf.Jinja2ChatFormatter(template=template, eos_token=self._model.eos_text(),
                                          bos_token=self._model.bos_text(), stop_token_ids=[self._model.token_eos()])
            return "chat_template.default", fmt.to_chat_handler()
        return "llama-2", lcf.get_chat_completion_handler("llama-2")  # llama-cpp-python's fallback

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str, additional_files: list[str] | None = None,
                        local_dir: str | os.PathLike | None = None, local_dir_use_symlinks="auto",
                        cache_dir: str | os.PathLike | None = None, **kwargs) -> "Llama":
        """Load ``filename`` (a name or glob pattern) of a Hugging Face Hub repository, with
        ``additional_files`` (the other shards of a split GGUF), through huggingface-hub (:mod:`.hub`).
        ``local_dir_use_symlinks`` is accepted and unused: huggingface-hub >= 1 no longer has it."""
        return cls(model_path=str(hub.download(repo_id, filename, additional_files, local_dir, cache_dir)), **kwargs)

    # -- ownership -----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the context and the model (also done by ``with``). From another thread while a call streams:
        that stream stops at its next step with a NativeError ("session is closed"); the step in flight ends
        first, so no native memory is freed under it."""
        stack, self._stack = getattr(self, "_stack", None), None
        if stack is not None:
            stack.close()

    @property
    def session(self) -> Session:
        if getattr(self, "_stack", None) is None:
            raise ConfigError("this Llama is closed")
        return self._session

    # -- tokens ----------------------------------------------------------------------------------------------------
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Text (UTF-8 bytes, or str) -> token ids, as ``llama_cpp.Llama.tokenize``."""
        if isinstance(text, str):
            text = utf8(text, "the text to tokenize")
        if not isinstance(text, (bytes, bytearray)):
            raise ConfigError(f"tokenize takes bytes or str, got {type(text).__name__}")
        self.session
        return self._model.tokenize(text.decode("utf-8", "replace"), add_special=add_bos, parse_special=special)

    def check_prompt_bytes(self, n_bytes: int) -> None:
        """ConfigError when a prompt of ``n_bytes`` UTF-8 bytes must have more than ``max_prompt_tokens`` tokens
        (``Model.max_piece_bytes``: at least n_bytes / the longest piece), told before tokenizing it: tokenizing
        megabytes is seconds of work that no cancel can interrupt."""
        longest = self._open_model.max_piece_bytes() if self.max_prompt_tokens is not None else None
        if longest and n_bytes > self.max_prompt_tokens * longest:
            raise ConfigError(f"the prompt of {n_bytes} bytes has at least {-(-n_bytes // longest)} tokens (no token "
                              f"is longer than {longest} bytes), over the limit of {self.max_prompt_tokens} "
                              "(max_prompt_tokens)")

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        """Token ids -> UTF-8 bytes, as ``llama_cpp.Llama.detokenize``."""
        self.session
        n_vocab = self._model.info.n_vocab
        bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < n_vocab]
        if bad:
            raise ConfigError(f"token ids must be integers in 0..{n_vocab - 1}, got {bad[:5]}")
        return b"".join(self._model.token_bytes(t, special=special) for t in tokens)

    def n_ctx(self) -> int:
        """The KV budget (live cells); llama-cpp-python's context size is replaced by it."""
        return self.session.budget.kv_budget

    @property
    def _open_model(self) -> Model:
        self.session  # ConfigError once this Llama is closed
        return self._model

    def n_vocab(self) -> int:
        return self._open_model.info.n_vocab

    def token_eos(self) -> int:
        return self._open_model.token_eos()

    def token_bos(self) -> int:
        return self._open_model.token_bos()

    @property
    def metadata(self) -> dict[str, str]:
        return self._open_model.metadata()

    def cancel(self) -> None:
        """Stop the call in progress from any thread: its stream raises CancelledError before its next decode
        step (a long prompt stops within one ``n_batch`` chunk of its prefill). No effect when none runs."""
        self.session.cancel()

    def cancel_thread(self, thread_id: int) -> None:
        """With ``n_parallel`` > 1: stop the call that thread ``thread_id`` runs (the others go on)."""
        if self._slots is None:
            self.cancel()
        else:
            self._slots.cancel_thread(thread_id)

    def set_client(self, client) -> None:
        """With ``n_parallel`` > 1: this thread's calls run for ``client`` (any hashable; None: anyone), and
        reuse or branch only sequences holding that client's conversation (a server's privacy rule)."""
        if self._slots is not None:
            self._slots.set_client(client)

    def slots(self) -> list[dict]:
        """Per sequence: id, state, live cells, budget, evictions, positions, whether a call holds it."""
        if self._slots is None:  # a pool of one
            return [dict(slot, leased=slot["state"] == "generating") for slot in self.session.pool.slots()]
        return self._slots.snapshot()

    def slot_action(self, slot_id: int, action: str, path: str | os.PathLike | None = None) -> dict:
        """llama-server's slot actions on sequence ``slot_id``: ``save`` its cache (with evictions, bookkeeping,
        policy state) to ``path``, ``restore`` it from ``path`` (it continues with identical logits), ``erase``
        it. ConfigError when the slot is processing a request (with one sequence: when a call is in progress)."""
        if action not in ("save", "restore", "erase"):
            raise ConfigError(f"action must be save, restore or erase, got {action!r}")
        if action != "erase" and path is None:
            raise ConfigError(f"{action} needs a file")
        if self._slots is None:
            if slot_id != 0:
                raise ConfigError(f"slot {slot_id} does not exist (0..0)")
            if self.session.generating:
                raise ConfigError("slot 0 is processing a request")
            n = self.session.n_past
            {"save": lambda: self.save_session(path), "restore": lambda: self.load_session(path),
             "erase": self.reset}[action]()
            return {"id_slot": 0, "n_tokens": n if action != "restore" else self.session.n_past}
        with self._slots.reserved(slot_id) as session:
            n = session.n_past
            if action == "save":
                session.save_state(path)
            elif action == "restore":
                session.load_state(path)
                n = session.n_past
            else:
                session.reset()
            return {"id_slot": slot_id, "n_tokens": n}

    def reset(self) -> None:
        """Forget the conversation: the next call starts a new sequence."""
        with self._lock:
            self._generation += 1
            self._close_active()
            self.session.reset()

    def save_session(self, path: str | os.PathLike) -> None:
        """Save the conversation's cache (with its evictions), bookkeeping and policy state to a file
        (``Session.save_state``); ``load_session`` continues it with identical logits."""
        with self._lock:
            self._close_active()
            self.session.save_state(path)

    def load_session(self, path: str | os.PathLike) -> None:
        """Continue a conversation saved by :meth:`save_session` (same model file and cache types)."""
        with self._lock:
            self._generation += 1
            self._close_active()
            self.session.load_state(path)
            self._stale_at = self._logits_mark()  # the restored sequence has no fresh logits: sample() re-decodes

    def _close_active(self) -> None:
        """Supersede the stream still being read, if any (a new call does so before it starts; the caller
        holds ``_lock``): its generation is released now and its next read raises ConfigError. A stream
        being read in another thread at this moment is left running (the session then refuses the new
        call: one sequence, one generation at a time)."""
        active, self._active = getattr(self, "_active", None), None
        if active is None:
            return
        if isinstance(active, Stream):
            if not active.supersede():
                self._active = active
            return
        try:  # a plain generator (``generate``)
            active.close()
        except ValueError:  # running in another thread right now: the session refuses the new call instead
            self._active = active

    # -- completions -------------------------------------------------------------------------------------------
    def _sampling(self, temperature, top_p, top_k, min_p, typical_p, repeat_penalty, frequency_penalty,
                  presence_penalty, seed, logit_bias, mirostat_mode: int = 0, mirostat_tau: float = 5.0,
                  mirostat_eta: float = 0.1, grammar=None) -> SamplingConfig:
        """The sampler settings of a call (llama-cpp-python's chain and meanings; unset temperature / top_p:
        the reasoning-model defaults; unset seed: the Llama's, a random one for LLAMA_DEFAULT_SEED)."""
        if seed is None:
            seed = self.seed
        if seed == LLAMA_DEFAULT_SEED:
            seed = int.from_bytes(os.urandom(4), "little") % LLAMA_DEFAULT_SEED
        text, root = grammar_text(grammar)
        # penalize_prompt=False: llama-cpp-python's penalties see the tokens its chain sampled, not the prompt
        return SamplingConfig(
            temperature=REASONING_TEMPERATURE if temperature is None else temperature,
            top_p=REASONING_TOP_P if top_p is None else top_p, top_k=top_k, seed=seed, min_p=min_p,
            typical_p=typical_p, repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, penalty_last_n=getattr(self, "last_n_tokens_size", LAST_N_TOKENS_SIZE),
            penalize_prompt=False, logit_bias=logit_bias or (), mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta, grammar=text, grammar_root=root)

    def _reasoning(self, budget: int | None, starts_open: bool) -> ReasoningBudget:
        budget = self.reasoning_budget if budget is None else check_budget(budget)
        if budget >= 0 and self._think_close is None:
            self._think_close = tuple(self._open_model.tokenize(CLOSE, add_special=False, parse_special=True))
        return ReasoningBudget(budget, self._think_close or (), starts_open)

    def _fim_tokens(self) -> tuple[int, int, int]:
        """(prefix, suffix, middle) fill-in-the-middle token ids (llama_vocab_fim_pre/suf/mid); ConfigError
        for a model without them."""
        m = self._open_model
        ll = m.nat.llama
        with m.using():
            ids = (int(ll.llama_vocab_fim_pre(m.vocab)), int(ll.llama_vocab_fim_suf(m.vocab)),
                   int(ll.llama_vocab_fim_mid(m.vocab)))
        if min(ids) < 0:
            raise ConfigError(f"suffix (fill-in-the-middle) needs a model with FIM tokens; {Path(self.model_path).name} "
                              "has none (llama_vocab_fim_pre/suf/mid)")
        return ids

    def _prompt_tokens(self, prompt, suffix) -> tuple[list[int], str | None]:
        """(the prompt's token ids, its text when given as text). With ``suffix``: the fill-in-the-middle
        prompt, as llama-cpp-python builds it: [BOS] <fim_pre> prompt <fim_suf> suffix <fim_mid> [EOS]
        (suffix first with ``spm_infill``; BOS / EOS where the vocabulary adds them)."""
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, (list, tuple)):
            text = None
            self.detokenize(list(prompt))  # validates the ids
        else:
            raise ConfigError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if suffix is None:
            if text is None:
                return list(prompt), None
            data = utf8(text, "prompt")
            self.check_prompt_bytes(len(data))
            return (self.tokenize(data, add_bos=True, special=True) if text else []), text
        if not isinstance(suffix, str):
            raise ConfigError(f"suffix must be a string, got {type(suffix).__name__}")
        fim = self._fim_tokens()
        prefix_data, suffix_data = utf8(text or "", "prompt"), utf8(suffix, "suffix")
        self.check_prompt_bytes(len(prefix_data) + len(suffix_data))
        prefix = self.tokenize(prefix_data, add_bos=False, special=False) if text else list(prompt or [])
        suffix_ids = self.tokenize(suffix_data, add_bos=False, special=False) if suffix else []
        m = self._open_model
        with m.using():
            add_bos, add_eos = m.nat.llama.llama_vocab_get_add_bos(m.vocab), m.nat.llama.llama_vocab_get_add_eos(m.vocab)
        bos, eos = self.token_bos(), self.token_eos()
        return fim_prompt(prefix, suffix_ids, fim, self.spm_infill, bos if add_bos and bos >= 0 else None,
                          eos if add_eos and eos >= 0 else None), text

    def create_completion(self, prompt: str | list[int], suffix: str | None = None, max_tokens: int | None = None,
                          temperature: float | None = None, top_p: float | None = None, min_p: float = 0.05,
                          typical_p: float = 1.0, logprobs: int | None = None, echo: bool = False,
                          stop: str | list[str] | None = None, frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, top_k: int = 40,
                          stream: bool = False, seed: int | None = None, tfs_z: float = 1.0, mirostat_mode: int = 0,
                          mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
                          stopping_criteria=None, logits_processor=None, grammar=None, logit_bias=None,
                          reasoning_budget: int | None = None, n: int = 1):
        """Complete ``prompt`` (text or token ids). Returns a completion dict, or an iterator of chunks with
        ``stream=True``. Sampling defaults suit reasoning models (temperature 0.6, top-p 0.95) and
        ``max_tokens=None`` lets the generation run to its end: the KV budget bounds memory, not length.
        n: answers to sample (OpenAI's ``n``; choice i uses seed + i when a seed is given), in parallel
        sequences sharing the prompt's cells with ``n_parallel`` >= n, else one after another; streamed, each
        chunk's choice has its ``index`` (:meth:`choice_steps`). The other arguments mean what they mean in llama-cpp-python (see
        :meth:`completion_steps`)."""
        if self._n_choices(n) > 1:
            args = dict(locals())
            for k in ("self", "n", "stream", "__class__"):
                args.pop(k, None)
            if stream:
                return (step.chunk for step in self.choice_steps(n, self.completion_steps, **args))
            return fan_out(n, lambda i: self.create_completion(**dict(args, seed=self._choice_seed(seed, i))), self._slots)
        steps = self.completion_steps(
            prompt, suffix=suffix, max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p,
            typical_p=typical_p, logprobs=logprobs, echo=echo, stop=stop, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, repeat_penalty=repeat_penalty, top_k=top_k, seed=seed, tfs_z=tfs_z,
            mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, model=model,
            stopping_criteria=stopping_criteria, logits_processor=logits_processor, grammar=grammar,
            logit_bias=logit_bias, reasoning_budget=reasoning_budget)
        if stream:
            return (step.chunk for step in steps)
        return responses.completion_from(steps, with_logprobs=logprobs is not None)

    __call__ = create_completion

    def completion_steps(self, prompt: str | list[int], suffix: str | None = None, max_tokens: int | None = None,
                         temperature: float | None = None, top_p: float | None = None, min_p: float = 0.05,
                         typical_p: float = 1.0, logprobs: int | None = None, echo: bool = False,
                         stop: str | list[str] | None = None, frequency_penalty: float = 0.0,
                         presence_penalty: float = 0.0, repeat_penalty: float = 1.0, top_k: int = 40,
                         seed: int | None = None, tfs_z: float = 1.0, mirostat_mode: int = 0,
                         mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
                         stopping_criteria=None, logits_processor=None, grammar=None,
                         logit_bias=None, reasoning_budget: int | None = None,
                         template: list[bool] | None = None) -> Iterator[ChunkStep]:
        """``create_completion(..., stream=True)`` with the statistics: an iterator of :class:`ChunkStep`
        (the stream chunk and the generation's statistics as of it). The prompt is decoded and the first
        token sampled at the call, so bad input and a prompt that does not fit the budget raise here.

        suffix: fill-in-the-middle (models with FIM tokens; others: ConfigError). logprobs: N >= 0 gives each
        chunk (and the full response) ``{"tokens", "text_offset", "token_logprobs", "top_logprobs"}`` with the
        N most likely alternatives per token (:mod:`.logprobs`; not with ``echo``). grammar: a
        ``llama_cpp.LlamaGrammar`` or GBNF text. logits_processor(input_ids, scores) -> scores and
        stopping_criteria(input_ids, logits) -> bool: callables or lists of them. reasoning_budget: tokens
        allowed inside an open ``<think>`` block before ``</think>`` is forced (None: the Llama's; -1:
        unlimited). ``tfs_z`` is accepted and unused, as in llama-cpp-python. A newer call on this Llama
        supersedes the stream: it then raises ConfigError at its next item. template: one flag per prompt token,
        True where a chat template wrote it (set by the chat path, :func:`.chat.template_marks`; policies such
        as ``said_words`` rank those tokens below the caller's words).
        """
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise ConfigError(f"max_tokens must be a positive integer or None (no limit), got {max_tokens!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ConfigError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        if logprobs is not None:
            if isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0:
                raise ConfigError(f"logprobs must be an integer >= 0 (alternatives per token) or None, got "
                                  f"{logprobs!r}")
            if echo:
                raise ConfigError("logprobs with echo=True is not supported: the prompt tokens' logprobs need "
                                  "every prompt row's logits, which the budgeted prefill does not keep")
        session = self.session
        tokens, prompt_text = self._prompt_tokens(prompt, suffix)
        if not tokens:
            raise ConfigError("the prompt is empty")
        if template is not None and (suffix is not None or len(template) != len(tokens)):  # checked here: a
            # reused prefix leaves the engine only the rest to check
            raise ConfigError(f"template marks {len(template)} tokens of a prompt of {len(tokens)}")
        if self.max_prompt_tokens is not None and len(tokens) > self.max_prompt_tokens:
            raise ConfigError(f"the prompt has {len(tokens)} tokens, over the limit of {self.max_prompt_tokens} "
                              "(max_prompt_tokens)")
        sampling = self._sampling(temperature, top_p, top_k, min_p, typical_p, repeat_penalty, frequency_penalty,
                                  presence_penalty, seed, logit_bias, mirostat_mode, mirostat_tau, mirostat_eta,
                                  grammar)
        opens = suffix is None and prompt_opens_thinking(
            prompt_text if prompt_text is not None else self.detokenize(tokens, special=True).decode("utf-8", "replace"))
        reasoning = self._reasoning(reasoning_budget, opens)
        processor = chained(logits_processor, "logits_processor")
        criteria = chained(stopping_criteria, "stopping_criteria")
        if self._slots is None:
            with self._lock:
                self._generation += 1
                self._close_active()
            if getattr(self, "cache", None) is not None:  # llama-cpp-python's prompt cache (set_cache)
                self._cache_lookup(tokens)
        echo_text = (prompt_text if prompt_text is not None
                     else self.detokenize(list(prompt)).decode("utf-8", "replace")) if echo else ""
        lp = CompletionLogprobs(self._model, logprobs, len(prompt)) if logprobs is not None else None
        on_done = (lambda generated: self._cache_store(tokens + generated)) if getattr(self, "cache", None) \
            is not None and self._slots is None else None  # as llama-cpp-python: prompt + completion is cached
        if self._slots is not None:  # n_parallel > 1: a sequence of its own, given back when the stream ends
            session = self._slots.lease(tokens)
        items = stream_generate(session, tokens, max_tokens, sampling, tuple(stops), reuse_prefix=True,
                                stopping_criteria=criteria, logits_processor=processor,
                                want_logits=logprobs is not None, reasoning=reasoning, template=template)
        if self._slots is not None:
            items = self._slots.holding(session, items)
        steps = Stream(primed(completion_chunks(items, model or self.model_path, echo_text, lp, on_done)))
        if self._slots is None:
            self._active = steps
        else:
            self._slots.primed()
        return steps

    # -- chat --------------------------------------------------------------------------------------------------------
    def create_chat_completion(self, messages: list[dict], functions=None, function_call=None, tools=None,
                               tool_choice=None, temperature: float | None = None, top_p: float | None = None,
                               top_k: int = 40, min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False,
                               stop: str | list[str] | None = None, seed: int | None = None, response_format=None,
                               max_tokens: int | None = None, presence_penalty: float = 0.0,
                               frequency_penalty: float = 0.0, repeat_penalty: float = 1.0, tfs_z: float = 1.0,
                               mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                               model: str | None = None, logits_processor=None, grammar=None, logit_bias=None,
                               logprobs: bool | None = None, top_logprobs: int | None = None,
                               reasoning_budget: int | None = None, n: int = 1):
        """A chat turn in OpenAI's shape (``choices[0].message`` or streamed ``delta``s), rendered by the chat
        handler of this model; reasoning is split into ``reasoning_content``. The conversation's common prefix
        with the previous call stays in the cache. ``response_format`` (json_object, json_schema) and
        ``tools`` / ``functions`` become grammars in the handler; a named ``tool_choice`` returns
        ``tool_calls``; ``logprobs=True`` (with ``top_logprobs``) gives chat logprobs. reasoning_budget: as in
        :meth:`completion_steps`. n: answers to sample, as in :meth:`create_completion`."""
        if self._n_choices(n) > 1:
            args = dict(locals())
            for k in ("self", "n", "stream", "__class__"):
                args.pop(k, None)
            if stream:
                return (step.chunk for step in self.choice_steps(n, self.chat_completion_steps, **args))
            return fan_out(n, lambda i: self.create_chat_completion(**dict(args, seed=self._choice_seed(seed, i))),
                           self._slots)
        kwargs = dict(functions=functions, function_call=function_call, tools=tools, tool_choice=tool_choice,
                      temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, typical_p=typical_p,
                      stop=stop, seed=seed, response_format=response_format, max_tokens=max_tokens,
                      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                      repeat_penalty=repeat_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                      mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, model=model,
                      logits_processor=logits_processor, grammar=grammar, logit_bias=logit_bias, logprobs=logprobs,
                      top_logprobs=top_logprobs, reasoning_budget=reasoning_budget)
        if stream:
            return (step.chunk for step in self.chat_completion_steps(messages, **kwargs))
        call, out = self._run_chat_handler(messages, stream=False, **kwargs)
        if self.reasoning_format == "deepseek":
            split_message(out, call.opens_thinking)
        out[responses.EXTENSION] = extension(call.stats)
        return out

    def chat_completion_steps(self, messages: list[dict], **kwargs) -> Iterator[ChunkStep]:
        """``create_chat_completion(..., stream=True)`` with the statistics: an iterator of :class:`ChunkStep`
        (the chat stream chunk and the generation's statistics as of it); the same keyword arguments."""
        call, chunks = self._run_chat_handler(messages, stream=True, **kwargs)
        return chat_steps(chunks, call, split=self.reasoning_format == "deepseek")

    def _run_chat_handler(self, messages, stream: bool, reasoning_budget: int | None = None, **kwargs):
        """Check the messages and arguments, render and start the turn through the chat handler: (the call's
        record, the handler's response or chunk iterator)."""
        check_messages(messages)
        # content given as text parts is joined (as llama-server does): chat templates expect strings
        messages = [flatten_text_parts(m) for m in messages]
        kwargs = chat_arguments(kwargs)
        if reasoning_budget is not None:
            check_budget(reasoning_budget)
        call = HandlerCall(self, reasoning_budget, messages)
        try:
            return call, self.chat_handler(llama=call, messages=messages, stream=stream, **kwargs)
        except EpikvError:
            raise
        except (jinja2.TemplateError, ValueError) as e:  # the template refused the conversation: its
            # raise_exception (a ValueError in llama-cpp-python) or an undefined name
            raise ConfigError(f"the chat template cannot render these messages: {e}") from None
