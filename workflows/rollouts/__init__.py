"""Rollouts: one build to many hosts in waves. Imports deploys and below."""
