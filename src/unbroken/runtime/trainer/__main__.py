"""`python -m unbroken.runtime.trainer [--coordinator HOST:PORT --group R]`: one trainer process (lifecycle.py)."""
from unbroken.runtime.trainer.lifecycle import main

main()
