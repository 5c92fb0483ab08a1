package podspec

import (
	"cmp"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
)

func TestKernelCmdlineConsole(t *testing.T) {
	cases := []struct {
		name, image, extra, want string
	}{
		{"nothing", "", "", "console=ttyS0"},
		{"image without console", "root=/dev/vda quiet", "", "console=ttyS0 root=/dev/vda quiet"},
		{"image names console", "console=ttyS0,115200 quiet", "", "console=ttyS0,115200 quiet"},
		{"image names another console", "console=hvc0", "loglevel=3", "console=hvc0 loglevel=3"},
		{"pod names console", "quiet", "console=ttyS1", "quiet console=ttyS1"},
		{"netconsole is not a console", "netconsole=@/,@10.0.0.1/", "", "console=ttyS0 netconsole=@/,@10.0.0.1/"},
		{"console= after -- goes to init", "quiet -- console=foo", "", "console=ttyS0 quiet -- console=foo"},
		{"spaces trimmed", "  quiet ", "  ", "console=ttyS0 quiet"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, KernelCmdline(qemu.ArchX86_64, tc.image, tc.extra))
		})
	}
	// aarch64 virt: the first serial port is the PL011, ttyAMA0.
	assert.Equal(t, "console=ttyAMA0 root=/dev/vda", KernelCmdline(qemu.ArchAArch64, "root=/dev/vda", ""))
	assert.Equal(t, "console=hvc0", KernelCmdline(qemu.ArchAArch64, "console=hvc0", ""))
}

// TestEmulatedKernelCmdline: no_timer_check on emulated x86-64 guests,
// then the node's emulatedKernelArgs (args), unless the command line names
// them already; nothing after "--" (init's) counts, nothing on KVM or
// aarch64.
func TestEmulatedKernelCmdline(t *testing.T) {
	idle := []string{"tsc=reliable", "sysctl.vm.compaction_proactiveness=0"}
	cases := []struct {
		name  string
		arch  qemu.Arch
		accel qemu.Accelerator
		args  []string
		in    string
		want  string
	}{
		{"x86 under tcg", qemu.ArchX86_64, qemu.AccelTCG, nil, "console=ttyS0 quiet", "no_timer_check console=ttyS0 quiet"},
		{"already there", qemu.ArchX86_64, qemu.AccelTCG, nil, "quiet no_timer_check", "quiet no_timer_check"},
		{"after -- is init's", qemu.ArchX86_64, qemu.AccelTCG, nil, "quiet -- no_timer_check", "no_timer_check quiet -- no_timer_check"},
		{"kvm keeps the check", qemu.ArchX86_64, qemu.AccelKVM, nil, "quiet", "quiet"},
		{"aarch64 has no 8254", qemu.ArchAArch64, qemu.AccelTCG, nil, "console=ttyAMA0", "console=ttyAMA0"},
		{"empty", qemu.ArchX86_64, qemu.AccelTCG, nil, "", "no_timer_check"},
		{"idle args, x86 under tcg", qemu.ArchX86_64, qemu.AccelTCG, idle, "console=ttyS0 quiet",
			"no_timer_check tsc=reliable sysctl.vm.compaction_proactiveness=0 console=ttyS0 quiet"},
		{"idle args, image chose its tsc", qemu.ArchX86_64, qemu.AccelTCG, idle, "tsc=unstable quiet",
			"no_timer_check sysctl.vm.compaction_proactiveness=0 tsc=unstable quiet"},
		{"idle args, after -- is init's", qemu.ArchX86_64, qemu.AccelTCG, idle, "quiet -- tsc=reliable",
			"no_timer_check tsc=reliable sysctl.vm.compaction_proactiveness=0 quiet -- tsc=reliable"},
		{"idle args, kvm: nothing", qemu.ArchX86_64, qemu.AccelKVM, idle, "quiet", "quiet"},
		{"idle args, aarch64: nothing", qemu.ArchAArch64, qemu.AccelTCG, idle, "quiet", "quiet"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, EmulatedKernelCmdline(tc.arch, tc.accel, tc.in, tc.args))
		})
	}
}

// TestFreePageReportingCmdline: an emulated VM with free page reporting
// asks its guest for reports from order 0, unless the command line names
// an order before "--" (the image's or the pod's wins); without reporting,
// or under KVM, nothing is added.
func TestFreePageReportingCmdline(t *testing.T) {
	cases := []struct {
		name      string
		reporting bool
		in, want  string
		accel     qemu.Accelerator
	}{
		{"kvm keeps the huge-page order", true, "console=ttyS0 quiet", "console=ttyS0 quiet", qemu.AccelKVM},
		{"reporting on", true, "console=ttyS0 quiet", "page_reporting.page_reporting_order=0 console=ttyS0 quiet", ""},
		{"reporting off", false, "console=ttyS0 quiet", "console=ttyS0 quiet", ""},
		{"empty", true, "", "page_reporting.page_reporting_order=0", ""},
		{"the image's order wins", true, "page_reporting.page_reporting_order=5 quiet", "page_reporting.page_reporting_order=5 quiet", ""},
		{"the pod's order wins", true, "console=ttyS0 quiet page_reporting.page_reporting_order=9", "console=ttyS0 quiet page_reporting.page_reporting_order=9", ""},
		{"after -- is init's", true, "quiet -- page_reporting.page_reporting_order=5",
			"page_reporting.page_reporting_order=0 quiet -- page_reporting.page_reporting_order=5", ""},
		{"another page_reporting argument is not the order", true, "page_reporting.other=1",
			"page_reporting.page_reporting_order=0 page_reporting.other=1", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, FreePageReportingCmdline(cmp.Or(tc.accel, qemu.AccelTCG), tc.in, tc.reporting))
		})
	}
}
