package podspec

import (
	"fmt"
	"strings"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
)

// featureNeeds says which features a pod needs before its VM may start:
// one line per feature that pods ask for.
var featureNeeds = []struct {
	feature string
	why     string
	needs   func(pod *corev1.Pod, plan Plan) bool
}{
	{config.FeatureUEFI, "annotation " + AnnotationFirmware + "=uefi", func(_ *corev1.Pod, p Plan) bool { return p.Firmware == qemu.FirmwareUEFI }},
	{config.FeatureJumpstarterExporter, "an exporter Secret (Jumpstarter)", func(pod *corev1.Pod, _ Plan) bool { return ExporterSecretName(pod) != "" }},
}

// Hold is why a pod waits for features.
type Hold struct {
	// Features the pod needs that are disabled, in featureNeeds order.
	Features []string
	Message  string
}

// DecideHold says whether a pod must wait before its first VM start
// because it needs a disabled feature (nil: it may start). A pod whose VM
// already started once is never held: configuration changes never touch
// running VMs nor restarts of started pods. Pure.
func DecideHold(pod *corev1.Pod, plan Plan, features *config.FeatureConfig, nodeName string, started bool) *Hold {
	if started {
		return nil
	}
	var off, why []string
	for _, n := range featureNeeds {
		if n.needs(pod, plan) && !features.Enabled(n.feature) {
			off = append(off, n.feature)
			why = append(why, n.why)
		}
	}
	if len(off) == 0 {
		return nil
	}
	fields := make([]string, len(off))
	for i, f := range off {
		fields[i] = "features." + f + ": false"
	}
	return &Hold{Features: off, Message: fmt.Sprintf(
		"pod needs %s (%s), disabled on node %s (%s in its configuration); it starts once enabled and the configuration is reloaded",
		strings.Join(off, ", "), strings.Join(why, "; "), nodeName, strings.Join(fields, ", "))}
}
