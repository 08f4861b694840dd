"""OpenRLHF (openrlhf 0.11.2): ``Experience`` batches, and lists of them.

OpenRLHF's experience maker (``openrlhf.trainer.ppo_utils.experience_maker``) hands the trainer a
list of ``Experience`` dataclasses (``openrlhf.trainer.ppo_utils.experience``), each a micro batch:
``sequences`` / ``attention_mask`` ``[B, T]``, the action-width fields ``action_mask``,
``action_log_probs``, ``values``, ``returns``, ``advantages``, ``kl``... ``[B, T-1]`` (token ``t + 1``
of ``sequences`` is the action at column ``t``: the tokens after the first, ``attention_mask``
shifted by one), per-sample ``rewards`` / ``scores`` / lengths ``[B]``, the lists ``index``,
``prompts``, ``labels``, ``images``, ``mm_train_inputs`` and the ``info`` dict of per-sample
values.

An ``Experience`` (or a list of them) is stored as the dict of its dataclass fields (a list batch
of such dicts), with a container tag naming the class (``format/batch/classes.py``); replay builds the
class again with those fields. The action-width fields are per-token fields of the shifted mask
(``format/batch/layout.py``, ``SHIFTED``).

openrlhf is never imported here; the class is imported on replay only when the package is
installed (``integrations.load``).
"""

from __future__ import annotations

__all__ = ["EXPERIENCE", "CLASSES", "ACTION_FIELDS"]

EXPERIENCE = "openrlhf.trainer.ppo_utils.experience:Experience"

# class path -> how it is stored (format/batch/classes.py): every dataclass field, nothing else
CLASSES = {EXPERIENCE: {"kind": "dataclass"}}

# the [B, T-1] fields of an Experience: one value per token after the first
ACTION_FIELDS = ("action_mask", "action_log_probs", "base_action_log_probs", "rollout_log_probs", "values",
                 "returns", "advantages", "kl")
