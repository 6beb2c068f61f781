"""shardflow on Kubernetes: the ``ShardflowCluster`` and ``ShardMigration`` resources, rendered
into KubeRay ``RayCluster`` manifests (:mod:`.render`, pure), the reconcile steps
(:mod:`.handlers`, effects behind injected interfaces) and the kopf operator that wires them to
the API server (:mod:`.operator`, needs the ``shardflow[k8s]`` extra)."""
