import sys
p = "liger_gen/templates/cross_entropy.py.jinja"
s = open(p).read()
d = sys.argv[1]
poll_atomic = """            arrived = tl.atomic_add(sync_ptr + 1 + block, 0, sem="acquire")
            while arrived < n_chunks:
                arrived = tl.atomic_add(sync_ptr + 1 + block, 0, sem="acquire")
"""
poll_volatile = """            arrived = tl.load(sync_ptr + 1 + block, volatile=True)
            while arrived < n_chunks:
                arrived = tl.load(sync_ptr + 1 + block, volatile=True)
            tl.atomic_add(sync_ptr + 1 + block, 0, sem="acquire")
"""
ticket = """        ticket = tl.atomic_add(sync_ptr, 1)
"""
pid = """        ticket = tl.program_id(0)
"""
assert poll_atomic in s and ticket in s
nowait = """            arrived = n_chunks
"""
if d in ("nowait", "pid_nowait"):
    s = s.replace(poll_atomic, nowait)
if d == "relaxed":
    s = s.replace(ticket, """        ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
""")
release = """            tl.atomic_add(sync_ptr + 1 + block, 1, sem="release")
"""
assert release in s
if d in ("relaxed_nowait", "relaxed_wait"):
    s = s.replace(release, release.replace('sem="release"', 'sem="relaxed"'))
    s = s.replace(ticket, ticket.replace("tl.atomic_add(sync_ptr, 1)", 'tl.atomic_add(sync_ptr, 1, sem="relaxed")'))
if d == "relaxed_nowait":
    s = s.replace(poll_atomic, nowait)
if d in ("volatile", "volatile_pid"):
    s = s.replace(poll_atomic, poll_volatile)
if d in ("atomic_pid", "volatile_pid", "pid_nowait"):
    s = s.replace(ticket, pid)
open(p, "w").write(s)
print("design", d)
