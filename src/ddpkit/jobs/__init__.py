"""Starting jobs on torch's elastic launcher: :func:`~ddpkit.launch` and :func:`~ddpkit.run_script` (``launch``),
the agent's side (``_agent``: restarts, rendezvous, errors), what the user sees of it (``_agent_log``), a rank's
side (``_worker``) and the runner of a user's script (``_script_runner``)."""
