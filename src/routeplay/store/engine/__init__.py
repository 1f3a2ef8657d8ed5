"""The engine-side store (LMDeploy's ``shared_store`` drop-in), where engines find it,
and the validation of what engines put into it."""
