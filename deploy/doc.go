// Package deploy holds no code: its tests check the operator-facing deploy
// material next to it (Kubernetes manifests, the Dockerfile, alert rules, the
// Grafana dashboard, the local cluster script) against the quotad binary.
// See README.md.
package deploy
