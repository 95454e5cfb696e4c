"""The arithmetic task's config section as a dataclass: the Hydra schema of conf/task/*.yaml;
``predmask.rl.task`` makes its data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from predmask.schemas.unknown_keys import check_known_keys


@dataclass(frozen=True)
class TaskConfig:
    """Shape of the arithmetic task (conf/task/arithmetic.yaml says what each field is); every field but the
    display ``label`` changes the data (and so the base-model cache key). Results never leave ``[0,
    max_number]``; the ``*_ops`` ranges are inclusive; ``slots`` = 0: no blanks, variable-length prompts."""

    max_number: int = 255
    operand_max: int = 9
    train_ops: tuple[int, int] = (1, 4)
    pretrain_ops: tuple[int, int] = (1, 5)
    eval_ops: tuple[int, int] = (4, 5)
    eval_size: int = 30
    slots: int = 5
    seed: int = 1234
    label: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.max_number < 20:
            raise ValueError(f"task.max_number must be >= 20, got {self.max_number}")
        if not 1 <= self.operand_max <= self.max_number:
            raise ValueError(f"task.operand_max must lie in [1, max_number={self.max_number}], got {self.operand_max}")
        for name in ("train_ops", "pretrain_ops", "eval_ops"):
            v = getattr(self, name)
            if len(v) != 2 or min(v) < 1:
                raise ValueError(f"task.{name} needs two values >= 1, got {v}")
        for name in ("train_ops", "pretrain_ops"):
            lo, hi = getattr(self, name)
            if lo > hi:
                raise ValueError(f"task.{name} must be an increasing range [lo, hi], got {(lo, hi)}")
        if self.eval_size < 1:
            raise ValueError(f"task.eval_size must be >= 1, got {self.eval_size}")
        most = max(self.train_ops[1], self.pretrain_ops[1], *self.eval_ops)
        if self.slots and self.slots < most:
            raise ValueError(f"task.slots ({self.slots}) must be 0 or >= the most operations of any split ({most})")

    @classmethod
    def from_mapping(cls, values: dict) -> TaskConfig:
        """Build from a config mapping (lists become tuples); unknown keys raise an error."""
        check_known_keys(cls, values, "task")
        v = dict(values)
        for k in ("train_ops", "pretrain_ops", "eval_ops"):
            if k in v:
                v[k] = tuple(int(x) for x in v[k])
        return cls(**v)

    def to_dict(self) -> dict:
        """The fields that determine the data (the base-model cache key): all but ``label``."""
        return {k: v for k, v in asdict(self).items() if k != "label"}
