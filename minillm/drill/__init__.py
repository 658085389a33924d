"""The interview drill (course map row 99): a question bank tied to the lectures.

    from minillm import drill
    bank = drill.load_bank()                 # or load_bank(topic="kv_cache", kind="numeric")
    inst = bank[0].instance(seed=0)
    print(inst.prompt); grade = inst.grade("320 KiB"); print(grade.score, grade.feedback)

Command line: python -m minillm.drill quiz | review | mock | export-anki FILE.apkg | key-numbers
"""
from .bank import KINDS, BankError, Grade, Instance, Question, get, load_bank, topics

__all__ = ["KINDS", "BankError", "Grade", "Instance", "Question", "get", "load_bank", "topics"]
