"""The models a cluster serves: their config, lifecycle, deployments, replicas, admission."""
