"""Chapter 04 graders are themselves tested: the solution passes, the unfilled exercise fails,
and planted bugs (a step that overshoots the token budget, LIFO admission that starves the oldest,
small requests overtaking a big one, leaked blocks of a preempted sequence, preempting the oldest
instead of the newest, a static batch that ends with its first member, a slot refilled a step
late, ...) are caught with a message that names the mistake."""


from minillm.grading import ch04, grade

from grader_contract import contract_tests, planted_bug_tests

NOTEBOOK = "04_continuous_batching.ipynb"
LIMIT = 60          # generous: a loaded 2-core CI machine must never time out a correct solution

# function the learner writes -> its exercise
GRADED = {
    "schedule_step": ch04.SCHEDULE_STEP,
    "slot_occupancy": ch04.SLOT_OCCUPANCY,
}


# ------------------------------------------------------------------ solution passes, stub fails

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, GRADED)


def test_chapter_lists_its_exercises_for_batch_grading():
    assert ch04.EXERCISES == (ch04.SCHEDULE_STEP, ch04.SLOT_OCCUPANCY)
    assert [e.id for e in ch04.EXERCISES] == ["ch04.schedule_step", "ch04.slot_occupancy"]


# ------------------------------------------------------------------ planted bugs: schedule_step

def _blocks(tokens, bs):
    return -(-tokens // bs)


def _schedule(running, waiting, free_blocks, block_size, max_num_seqs, token_budget, *,
              victim="newest", give_back="all", admit_order="fcfs", check_budget="<=",
              overtake=False, admit_after_preempt=False, check_seqs=True, decode_block="boundary"):
    """A configurable scheduler: the default is right; each keyword plants one mistake."""
    bs = block_size
    scheduled, preempted = {}, []
    active = list(running)
    budget = token_budget
    for seq in running:
        if seq.id in preempted:
            continue
        if decode_block == "boundary":
            need = _blocks(seq.num_computed + 1, bs) - _blocks(seq.num_computed, bs)
        else:
            need = 1
        while need > free_blocks and seq in active:
            v = active.pop() if victim == "newest" else active.pop(0)
            preempted.append(v.id)
            free_blocks += _blocks(v.num_computed, bs) if give_back == "all" else 1
            if give_back == "none":
                free_blocks -= 1
                break
        if seq not in active:
            continue
        free_blocks -= need
        scheduled[seq.id] = 1
        budget -= 1
    if not preempted or admit_after_preempt:
        order = list(waiting) if admit_order == "fcfs" else list(reversed(waiting))
        for seq in order:
            tokens = seq.num_tokens - seq.num_computed
            need = _blocks(tokens, bs)
            fits_budget = {"<=": tokens <= budget, "<": tokens < budget, "none": True}[check_budget]
            full = check_seqs and len(active) >= max_num_seqs
            if full or not fits_budget or need > free_blocks:
                if overtake:
                    continue
                break
            active.append(seq)
            scheduled[seq.id] = tokens
            budget -= tokens
            free_blocks -= need
    return {"scheduled": scheduled, "preempted": preempted, "free_blocks": free_blocks}


def step_overshoots_budget(running, waiting, free_blocks, block_size, max_num_seqs, token_budget):
    return _schedule(running, waiting, free_blocks, block_size, max_num_seqs, token_budget,
                     check_budget="none")


def step_budget_strict(running, waiting, free_blocks, block_size, max_num_seqs, token_budget):
    return _schedule(running, waiting, free_blocks, block_size, max_num_seqs, token_budget,
                     check_budget="<")


def step_lifo_admission(running, waiting, free_blocks, block_size, max_num_seqs, token_budget):
    return _schedule(running, waiting, free_blocks, block_size, max_num_seqs, token_budget,
                     admit_order="lifo")


def step_lets_small_ones_overtake(running, waiting, free_blocks, block_size, max_num_seqs,
                                  token_budget):
    return _schedule(running, waiting, free_blocks, block_size, max_num_seqs, token_budget,
                     overtake=True)


def step_leaks_preempted_blocks(running, waiting, free_blocks, block_size, max_num_seqs,
                                token_budget):
    return _schedule(running, waiting, free_blocks, block_size, max_num_seqs, token_budget,
                     give_back="one")


def step_preempts_the_oldest(running, waiting, free_blocks, block_size, max_num_seqs,
                             token_budget):
    return _schedule(running, waiting, free_blocks, block_size, max_num_seqs, token_budget,
                     victim="oldest")


def step_admits_after_preempting(running, waiting, free_blocks, block_size, max_num_seqs,
                                 token_budget):
    return _schedule(running, waiting, free_blocks, block_size, max_num_seqs, token_budget,
                     admit_after_preempt=True)


def step_ignores_max_num_seqs(running, waiting, free_blocks, block_size, max_num_seqs,
                              token_budget):
    return _schedule(running, waiting, free_blocks, block_size, max_num_seqs, token_budget,
                     check_seqs=False)


def step_new_block_every_decode(running, waiting, free_blocks, block_size, max_num_seqs,
                                token_budget):
    return _schedule(running, waiting, free_blocks, block_size, max_num_seqs, token_budget,
                     decode_block="always")


def step_sorts_the_callers_list(running, waiting, free_blocks, block_size, max_num_seqs,
                                token_budget):
    out = _schedule(running, waiting, free_blocks, block_size, max_num_seqs, token_budget)
    for v in out["preempted"]:                    # "moves" victims to the waiting list in place
        seq = next(s for s in running if s.id == v)
        running.remove(seq)
        waiting.insert(0, seq)
    return out


# ------------------------------------------------------------------ planted bugs: slot_occupancy

def _occupancy(output_lens, max_num_seqs, scheduling, *, batch_len=max, delay=0, order=None,
               waiting_rule="queue", validate=True):
    if validate:
        if scheduling not in ("static", "continuous"):
            raise ValueError("bad scheduling")
        if max_num_seqs < 1 or any(m < 1 for m in output_lens):
            raise ValueError("bad input")
    lens = list(output_lens) if order is None else order(list(output_lens))
    slots = max_num_seqs
    if scheduling == "static":
        steps = idle = idle_waiting = 0
        for i in range(0, len(lens), slots):
            batch = lens[i:i + slots]
            n = batch_len(batch)
            for k in range(n):
                empty = slots - sum(1 for m in batch if m > k)
                idle += empty
                if i + slots < len(lens) or waiting_rule == "all":
                    idle_waiting += empty
            steps += n
        return {"steps": steps, "idle_slot_steps": idle, "idle_while_waiting": idle_waiting}
    free_at = [0] * slots                      # the step each slot can start a new request
    starts = []
    for m in lens:
        s = min(range(slots), key=lambda j: free_at[j])
        starts.append((free_at[s], m))
        free_at[s] = free_at[s] + m + delay
    steps = max((a + m for a, m in starts), default=0)
    idle = idle_waiting = 0
    for k in range(steps):
        busy = sum(1 for a, m in starts if a <= k < a + m)
        idle += slots - busy
        if any(a > k for a, _ in starts) or waiting_rule == "all":
            idle_waiting += slots - busy
    return {"steps": steps, "idle_slot_steps": idle, "idle_while_waiting": idle_waiting}


def occ_batch_lasts_first_member(output_lens, max_num_seqs, scheduling):
    return _occupancy(output_lens, max_num_seqs, scheduling, batch_len=lambda b: b[0])


def occ_refills_a_step_late(output_lens, max_num_seqs, scheduling):
    return _occupancy(output_lens, max_num_seqs, scheduling, delay=1)


def occ_refills_in_the_same_step(output_lens, max_num_seqs, scheduling):
    return _occupancy(output_lens, max_num_seqs, scheduling, delay=-1)


def occ_counts_every_idle_slot_as_waiting(output_lens, max_num_seqs, scheduling):
    return _occupancy(output_lens, max_num_seqs, scheduling, waiting_rule="all")


def occ_static_sorted_by_length(output_lens, max_num_seqs, scheduling):
    return _occupancy(output_lens, max_num_seqs, scheduling,
                      order=sorted if scheduling == "static" else None)


def occ_no_validation(output_lens, max_num_seqs, scheduling):
    if scheduling == "dynamic":
        scheduling = "continuous"
    return _occupancy(output_lens, max(1, max_num_seqs), scheduling, validate=False)


# exercise, bug, a check it must fail, words that check's message must contain
BUGS = [
    ("schedule_step", step_overshoots_budget, "token budget", "more than the token budget"),
    ("schedule_step", step_budget_strict, "exact fit", "compare with <="),
    ("schedule_step", step_lifo_admission, "token budget", "(LIFO)"),
    ("schedule_step", step_lifo_admission, "max_num_seqs", "(LIFO)"),
    ("schedule_step", step_lets_small_ones_overtake, "no overtaking", "can starve a long request"),
    ("schedule_step", step_leaks_preempted_blocks, "blocks come back", "a leak"),
    ("schedule_step", step_leaks_preempted_blocks, "preempts itself", "a leak"),
    ("schedule_step", step_preempts_the_oldest, "most recently admitted", "OLDEST"),
    ("schedule_step", step_preempts_the_oldest, "preempts itself", "OLDEST"),
    ("schedule_step", step_preempts_the_oldest, "newest first", "OLDEST"),
    ("schedule_step", step_admits_after_preempting, "admits nobody", "nobody is admitted"),
    ("schedule_step", step_ignores_max_num_seqs, "max_num_seqs", "more than max_num_seqs=4"),
    ("schedule_step", step_new_block_every_decode, "last block is full", "multiple of block_size"),
    ("schedule_step", step_sorts_the_callers_list, "untouched", "your input lists read"),
    ("slot_occupancy", occ_batch_lasts_first_member, "arrival order", "LONGEST"),
    ("slot_occupancy", occ_static_sorted_by_length, "arrival order", "by length"),
    ("slot_occupancy", occ_refills_a_step_late, "very next step", "one step late"),
    ("slot_occupancy", occ_refills_in_the_same_step, "very next step", "still holds the slot"),
    ("slot_occupancy", occ_counts_every_idle_slot_as_waiting, "only steps", "every idle slot-step"),
    ("slot_occupancy", occ_no_validation, "ValueError", "raise ValueError"),
]


(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)


def test_a_bug_is_also_caught_by_the_random_check():
    # the random-state check is not a formality: it catches each kind of mistake on its own
    for name, bug in (("schedule_step", step_overshoots_budget),
                      ("schedule_step", step_lifo_admission),
                      ("schedule_step", step_leaks_preempted_blocks),
                      ("schedule_step", step_preempts_the_oldest),
                      ("slot_occupancy", occ_batch_lasts_first_member),
                      ("slot_occupancy", occ_refills_a_step_late)):
        result = grade(GRADED[name], bug, time_limit=LIMIT)
        assert any("random" in f for f in result.failed), (bug.__name__, str(result))


def test_a_learner_function_that_raises_or_returns_junk_is_reported():
    def raises(*args):
        raise KeyError("oops")

    def junk(*args):
        return [1, 2, 3]

    for exercise in GRADED.values():
        for fn, words in ((raises, "raised KeyError"), (junk, "expected a dict")):
            result = grade(exercise, fn, time_limit=LIMIT)
            assert result.score <= 1, str(result)     # at most the bad-input check passes
            assert any(words in m for m in result.messages), (fn.__name__, result.messages)


# ------------------------------------------------------------------ the cases are what they claim

def test_the_hand_made_cases_are_what_the_checks_claim():
    # the expected answers come from minillm's Scheduler; pin the ones the prose relies on
    ref = ch04._reference
    assert ref(ch04._PREEMPT) == {"scheduled": {"a": 1, "b": 1}, "preempted": ["c"],
                                  "free_blocks": 2}
    assert ref(ch04._SELF) == {"scheduled": {"a": 1}, "preempted": ["b"], "free_blocks": 2}
    assert ref(ch04._REPEAT)["preempted"] == ["d", "c"]
    assert ref(ch04._NO_ADMIT)["scheduled"] == {"a": 1, "b": 1}           # e would fit
    assert ref(ch04._BUDGET)["scheduled"] == {"a": 1, "b": 1, "d": 10}
    assert ref(ch04._BUDGET_EXACT)["scheduled"] == {"a": 1, "b": 1, "d": 10, "e": 7}
    assert ref(ch04._HEAD_BLOCKS)["scheduled"] == {"a": 1}                 # e fits, must wait
    assert ref(ch04._BOUNDARY)["free_blocks"] == 3                         # a and b took one
    occ = ch04._occupancy_reference
    assert occ([4, 1, 1, 1], 2, "static") == {"steps": 5, "idle_slot_steps": 3,
                                              "idle_while_waiting": 3}
    assert occ([4, 1, 1, 1], 2, "continuous") == {"steps": 4, "idle_slot_steps": 1,
                                                  "idle_while_waiting": 0}
    assert occ([], 3, "static") == {"steps": 0, "idle_slot_steps": 0, "idle_while_waiting": 0}


def test_random_states_cover_preemption_admission_and_refusal():
    import random
    rng = random.Random(404)
    plans = [ch04._reference(ch04._random_state(rng)) for _ in range(300)]
    assert sum(bool(p["preempted"]) for p in plans) >= 50            # preemption ...
    assert sum(len(p["preempted"]) >= 2 for p in plans) >= 10        # ... cascading
    assert sum(any(k.startswith("w") for k in p["scheduled"]) for p in plans) >= 50   # admission
    assert sum(not p["preempted"] and not any(k.startswith("w") for k in p["scheduled"])
               for p in plans) >= 50                                  # nobody fits
