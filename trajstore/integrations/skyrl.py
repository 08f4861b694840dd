"""SkyRL (skyrl-train 0.3.1): training batches with ``.metadata``, replay-buffer experiences and
the generator's output.

* ``TrainingInputBatch`` / ``TrainingOutputBatch`` (``skyrl_train.training_batch``) are dict
  subclasses of tensors (``TensorBatch``) carrying a ``metadata`` dict (``uids``,
  ``response_length``, ``avg_response_length``, ``trajectory_ids``, ``pad_size``, ``metrics``...)
  that the trainer's next functions read. They are stored as their dict of tensors plus a container
  tag naming the class and holding ``metadata`` (a typed document, docs/FORMAT.md 3.8); replay
  builds the class from the tensors (its constructor recomputes ``_batch_size`` and ``_device``)
  and sets ``metadata`` again.
* ``Experience`` (``skyrl_train.dataset.replay_buffer``): a dataclass, stored as the dict of its
  fields, rebuilt on replay.
* ``GeneratorOutput`` (``skyrl_train.generators.base``) is a ``TypedDict``, a plain dict at run
  time: its per-sample lists are per-trajectory values. Its step-wise ``trajectory_ids`` are
  ``TrajectoryID`` dataclasses, stored as typed values of kind ``obj`` (docs/FORMAT.md 3.8) and
  rebuilt as ``TrajectoryID`` where skyrl-train is installed.

The ``[B, R]`` response fields of a training batch (``response_mask``, ``loss_mask``,
``rollout_logprobs``, ``rewards``, ``advantages``...) are the last ``R`` columns of the ``[B, T]``
``attention_mask``; ``format/batch/layout.py`` stores them per token (``TAIL``).

skyrl_train is never imported here; its classes are imported on replay only when the package is
installed (``integrations.load``).
"""

from __future__ import annotations

__all__ = ["TRAINING_INPUT", "TRAINING_OUTPUT", "EXPERIENCE", "TRAJECTORY_ID", "CLASSES", "VALUE_CLASSES"]

_MOD = "skyrl_train.training_batch"
TRAINING_INPUT = f"{_MOD}:TrainingInputBatch"
TRAINING_OUTPUT = f"{_MOD}:TrainingOutputBatch"
EXPERIENCE = "skyrl_train.dataset.replay_buffer:Experience"
TRAJECTORY_ID = "skyrl_train.generators.base:TrajectoryID"

# what TensorBatch.__init__ sets from the tensors it is given: recomputed on replay, not stored
_DERIVED = ("_batch_size", "_device")

# class path -> how it is stored (format/batch/classes.py)
CLASSES = {
    TRAINING_INPUT: {"kind": "dict", "keep": ("metadata",), "derived": _DERIVED},
    TRAINING_OUTPUT: {"kind": "dict", "keep": ("metadata",), "derived": _DERIVED},
    EXPERIENCE: {"kind": "dataclass"},
}

# dataclasses stored inside values (typed ``obj`` documents), rebuilt field by field
VALUE_CLASSES = frozenset({TRAJECTORY_ID})
