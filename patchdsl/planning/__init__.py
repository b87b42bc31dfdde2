"""Planning: a checked spec resolved against a model's index into a plan.

    check.py        ops exist, flags typed against each op's schema, kind names (CheckedSpec)
    select.py       which modules each rule matches; diagnostics.py: why a rule matches nothing
    site.py         a Site and its one constructor (kernel keys derived with the op's key_params)
    plan.py         the PatchPlan: precedence, conflicts, sites, totals; JSON round-trip
    plan_file.py    a plan file (untrusted JSON) checked field by field
    site_check.py   the check of a site against the live module (plan and apply run it)
    availability.py whether the plan's kernels can be had on this machine
    planner.py      the entry: spec + model -> plan, the spec checked once
    text.py         the plan as text (fixed columns, every count from one place)
    suggestion.py   the spec that patches what plans on a model

(The package is named planning, not plan: ``patchdsl.plan`` is the public function.)
"""
