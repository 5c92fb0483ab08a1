// Package cluster starts a real, throwaway Kubernetes control plane (etcd,
// kube-apiserver, kube-scheduler, kube-controller-manager) on loopback for
// tests, with generated certificates and kubeconfigs, and tears it down
// leaving no process behind.
package cluster
