"""Privacy auditing (SPEC §7): membership inference and canary exposure against fine-tuned runs.

metrics       AUC, TPR at FPR, ROC, empirical ε lower bound (pure functions over score arrays)
exposure      canary exposure from a rank or a distribution fit (pure)
audit_records reads the member / non-member / public split and canaries recorded before training
              (chosen and written by ``dptext.data.audit_split``; canary secrets in ``dptext.data.canaries``)
scoring       what an attacker observes of a model on a record
attack_models loss-threshold, shadow-model (logistic regression) and offline LiRA attacks
references    shadow / reference models trained with the target's recipe on its public pool, through the
              training entry point the caller passes in (``dptext mia`` passes ``run_finetune``)
audit         ``run_mia``: audits of run directories; canary_audit: ``canary_exposure``
one_run       the one-run audit's ε lower bound (Steinke et al. 2023); one_run_audit: ``one_run_audits``
"""
