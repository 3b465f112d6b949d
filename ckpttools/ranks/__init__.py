"""Running one command over several processes: the launcher's environment and process group (`distributed`) and
node-local checkpoints, where each node holds only its own ranks' files (`nodelocal`)."""
