"""The coordination store, as every process of a run sees it.

Runs in every process (coordinator, trainers, launcher, snapshot agents). Owns: every store key (keys.py,
the only file that spells one), connecting to a TCPStore or an etcd cluster and reading it (client.py,
etcd.py), the watches that wake a process when a key changes (watch.py), and the words of a dead verdict
(reasons.py). May import: the standard library, torch.distributed's store types, unbroken.config and
unbroken.storeurl; nothing else of runtime/.
"""
