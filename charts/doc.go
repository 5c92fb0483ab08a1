// Package charts holds the Helm chart of qemu-kubelet (charts/qemu-kubelet)
// and its tests: helm lint and helm template with each ci/*.yaml values
// file, schema rejections, CRD copies in sync with config/crd, and a
// server-side dry-run apply plus a real install against a real
// kube-apiserver, where the node agent and the controller run with exactly
// the RBAC the chart grants. helm is built from its Go module by
// hack/build-helm.sh. There is no Go code here besides the tests.
package charts
