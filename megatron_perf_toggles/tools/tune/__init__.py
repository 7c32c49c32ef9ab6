"""``megatron-perf-toggles tune``: measure the toggles on your own command line and write a profile.

It is an ``ablate`` experiment run two or three times, through ablate's own stages (runs, schedule, execution,
analysis, report), with a decision rule between and after (nothing here measures or checks confounds on its own):

1. **Leave-one-out from the defaults**: every toggle on (the baseline), then each one off. Removing
   a toggle is either detectably slower (its interval lies below 1: keep it on), detectably faster
   at a Bonferroni-corrected confidence (turn it off; see :func:`correct_turn_offs`), or neither
   (unresolved). A toggle whose arm failed is not measured and keeps its default; a baseline that
   never finishes stops tune without a profile.
2. **Factorial of the unresolved toggles** (at most ``--max-factorial`` of them), with the resolved
   ones pinned to their decided values, every combination compared with all of them on. A
   combination replaces "all on" only when it is detectably faster, at a confidence corrected for
   picking among many arms (Bonferroni: ``1 - (1 - confidence) / (arms - 1)``); otherwise the
   unresolved toggles stay on.
3. **Confirmation**, where the chosen values differ from the defaults: the two sets against each
   other; unless the chosen set is faster or not detectably different, the defaults are kept.

Why keep on what is not detectably different: the defaults are the fast settings where they were
measured, a toggle that does nothing costs nothing, and turning one off on the strength of noise
would make a profile worse than no profile. Only an effect the experiment resolves moves a value.

Toggles a guard keeps off on this setup (no TE kernel, FSDP, ...) take no part: the guard decides
them in every run, with or without a profile. No block starts that is expected to end after
``--budget`` (priced by the runs finished so far; in the later phases, by leave-one-out's); a
re-run of the same command resumes (finished runs are skipped and cost nothing), as ablate's does.
A phase the budget cuts short before any comparison decides nothing: the unresolved toggles keep
their defaults, and chosen values stay unconfirmed. The result is
OUT/profile.json (``core.profile.render_profile``) and OUT/profile.md; each phase keeps ablate's own
results in OUT/leave-one-out/, OUT/factorial/ and OUT/confirmation/.

The package: rule.py (the decision rule on the phases' result rows), evidence.py (what each
choice quotes), phases.py (the phases, each one experiment through ablate's stages),
output.py (profile.json and profile.md), command.py (the options and the command).
"""
