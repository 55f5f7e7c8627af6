"""Rollouts: one build to many hosts in waves. `request` holds the operator's intents,
`driver` advances a rollout by the `steps`, `rows` the reads and moves they share, `waves`
the wave sizes, `status` what operators read. Imports deploys and below."""
