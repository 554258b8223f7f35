"""Synthetic position tasks and their character tokenizer."""

from .synthetic import TASKS, TaskConfig, TaskData, TaskSplit, make_task_data, task_answer
from .tokenizer import CHAR_VOCAB, CharVocab, build_tokenizer

__all__ = [
    "TASKS", "TaskConfig", "TaskData", "TaskSplit", "make_task_data", "task_answer",
    "CHAR_VOCAB", "CharVocab", "build_tokenizer",
]
