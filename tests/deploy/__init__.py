"""The Helm chart's offline tests, and the policy checks the scheduler's tests apply to the Job bodies
it builds (`from deploy.policy import pod_spec_violations`)."""
