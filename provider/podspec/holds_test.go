package podspec

import (
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

func TestDecideHold(t *testing.T) {
	uefi := Plan{Firmware: qemu.FirmwareUEFI}
	plain := Plan{Firmware: qemu.FirmwareBIOS}
	exporterPod := podtest.VMPod(func(p *corev1.Pod) { p.Annotations = map[string]string{v1alpha1.JumpstarterSecretAnnotation: "js"} })
	tests := []struct {
		name     string
		pod      *corev1.Pod
		plan     Plan
		features *config.FeatureConfig
		started  bool
		want     []string // held for; nil: starts
	}{
		{"defaults: nothing held", exporterPod, uefi, nil, false, nil},
		{"uefi pod, uefi off", podtest.VMPod(), uefi, featuresWith(config.FeatureUEFI), false, []string{"uefi"}},
		{"uefi pod, uefi on", podtest.VMPod(), uefi, featuresWith(config.FeatureAttach), false, nil},
		{"bios pod, uefi off", podtest.VMPod(), plain, featuresWith(config.FeatureUEFI), false, nil},
		{"exporter pod, exporter off", exporterPod, plain, featuresWith(config.FeatureJumpstarterExporter), false, []string{"jumpstarterExporter"}},
		{"both off", exporterPod, uefi, featuresWith(config.FeatureJumpstarterExporter, config.FeatureUEFI), false, []string{"uefi", "jumpstarterExporter"}},
		{"already started: never held", exporterPod, uefi, featuresWith(config.FeatureJumpstarterExporter, config.FeatureUEFI), true, nil},
		{"port-forward off holds no pod", podtest.VMPod(), plain, featuresWith(config.FeaturePortForward, config.FeatureAttach), false, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := DecideHold(tt.pod, tt.plan, tt.features, "n1", tt.started)
			if tt.want == nil {
				assert.Nil(t, h)
				return
			}
			require.NotNil(t, h)
			assert.Equal(t, tt.want, h.Features)
			for _, f := range tt.want {
				assert.Contains(t, h.Message, "features."+f+": false")
			}
			assert.Contains(t, h.Message, "node n1")
			assert.Contains(t, h.Message, "starts once enabled")
		})
	}
}

func featuresWith(off ...string) *config.FeatureConfig {
	f := config.DefaultFeatures()
	for _, n := range off {
		f.Gates[n] = false
	}
	return f
}
