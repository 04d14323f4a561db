"""lm-evaluation-harness's `LM` backed by a built-in decoder: log-likelihoods through xlatrain/evaluation/scoring.py's
compiled forward, generations through the KV-cache decode loop
(xlatrain/models/sampling.py: prompts of different lengths left-padded into one batch, stop ids and stop strings).
The harness's TemplateLM encodes each (context, continuation) as its HFLM does; the rest follows HFLM: BOS where the
tokenizer begins texts with one, empty contexts after the BOS (or the end-of-text), rolling windows of the model's
context for loglikelihood_rolling, contexts cut from the left to leave room for max_gen_toks.

With several processes the harness runs whole in each (its own world of one: every process computes every metric);
the LM splits the work of each call between them and gathers the results (devices.py)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from xlatrain.evaluation.devices import everyones_results, my_share
from xlatrain.evaluation.scoring import Scorer, TextModel
from xlatrain.models.sampling import Sampling, generate_until

DEFAULT_GENERATED_TOKENS = 256
"""HFLM's max_gen_toks where a task gives none."""


class XlatrainLM(TemplateLM):
    """`model` with the weights `variables`; `scorer`: its compiled forward (Scorer)."""

    def __init__(self, model: TextModel, scorer: Scorer, variables: Any):
        super().__init__()
        self.model, self._scorer, self._variables = model, scorer, variables
        self._tokenizer = model.tokenizer
        self.batch_size = scorer.batch_size

    @property
    def eot_token_id(self) -> int:
        return self._tokenizer.end_of_text

    @property
    def prefix_token_id(self) -> int:
        return self._tokenizer.bos if self._tokenizer.bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.model.context

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's ids, after its BOS where it begins texts with one (add_special_tokens None or True)."""
        ids = self._tokenizer.encode_batch([string])[0].tolist()
        begin = self._tokenizer.around_documents()[0].tolist()
        if add_special_tokens is False or not begin or (add_special_tokens is None and ids[:len(begin)] == begin):
            return ids
        return begin + ids

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        scored = self._scorer.score(self._variables, [(np.asarray(context), np.asarray(continuation))
                                                      for _, context, continuation in requests])
        return [(s.log_likelihood, s.greedy) for s in scored]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each text's windows of the model's context, all of them scored together, summed per text."""
        owners, windows = [], []
        for owner, (string,) in enumerate(request.args for request in requests):
            for window in utils.get_rolling_token_windows(token_list=self.tok_encode(string),
                                                          prefix_token=self.prefix_token_id,
                                                          max_seq_len=self.max_length, context_len=1):
                context, continuation = utils.make_disjoint_window(window)
                owners.append(owner)
                windows.append((None, context, continuation))
        totals = [0.0] * len(requests)
        for owner, (log_likelihood, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += log_likelihood
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, as a request's do_sample and temperature say) continuations, the requests of one
        generation setting decoded together in batches."""
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        batches = [members[start:start + self.batch_size] for members in groups.values()
                   for start in range(0, len(members), self.batch_size)]
        mine = {}
        for _, batch in my_share(batches):
            settings = normalize_gen_kwargs(dict(requests[batch[0]].args[1]), DEFAULT_GENERATED_TOKENS)
            # The end-of-text stops the decode loop as an id; as text it decodes to nothing here
            until = handle_stop_sequences(settings.pop("until", None), eos=None)
            new_tokens = settings.pop("max_gen_toks")
            prompts = [np.asarray(self.tok_encode(requests[i].args[0])[-(self.max_length - new_tokens):], np.int32)
                       for i in batch]
            devices = self._scorer.mesh.size  # the rows split over them, the last batch filled up with its first
            prompts += prompts[:1] * (-len(prompts) % devices)
            sampling = Sampling(new_tokens, float(settings.get("temperature", 0.0)), None, 1.0,
                                (self.eot_token_id,), min(self._tokenizer.vocab_size, self.model.vocab))
            continued = generate_until(self.model.graphdef, self._variables, prompts, jax.random.PRNGKey(0), sampling,
                                       self._tokenizer.decode, tuple(until), rows=self._scorer.rows)
            mine.update((i, postprocess_generated_text(generation=text, stop=until, think_end_token=None))
                        for i, (text, _) in zip(batch, continued))
        return everyones_results("generations", mine, len(requests))


def harness_scores(lm: XlatrainLM, tasks: list[str], manager: Any, limit: int | None) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of lm-evaluation-harness's simple_evaluate on `lm` (no bootstrapped errors)."""
    from lm_eval import simple_evaluate

    results = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, bootstrap_iters=0,
                              log_samples=False)
    return {task: {metric.split(",")[0]: float(value) for metric, value in found.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in metric}
            for task, found in results["results"].items()}
