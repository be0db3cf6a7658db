"""Verification: the lowered module run against the independent numpy reference and its compiled
HLO's collectives matched against the plan (``shardc verify``, ``shardc compare``)."""
