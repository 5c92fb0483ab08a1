package qemu

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// kvmWorks reports whether this machine's KVM runs guest code; the probe
// tests assert the behaviour for the machine they run on. On the project's CI
// machines /dev/kvm exists but fails (nested), so the fallback path is the one
// exercised there.
func TestProbeAccelerator(t *testing.T) {
	testutil.SkipIfShort(t, "QEMU")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	tcg, err := ProbeAccelerator(ctx, ProbeOptions{Policy: AccelTCGOnly, QEMUBinary: "/nonexistent/qemu"})
	if err != nil {
		t.Fatalf("tcg policy: %v", err)
	}
	if tcg.Accelerator != AccelTCG || tcg.KVMError != "" || tcg.KVMProbeDuration != 0 {
		t.Fatalf("tcg policy must not try KVM: %+v", tcg)
	}

	prefer, err := ProbeAccelerator(ctx, ProbeOptions{Policy: AccelPreferKVM, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatalf("prefer-kvm: %v", err)
	}
	t.Logf("prefer-kvm: %+v", prefer)
	require, rerr := ProbeAccelerator(ctx, ProbeOptions{Policy: AccelRequireKVM, Timeout: 5 * time.Second})
	switch prefer.Accelerator {
	case AccelTCG:
		if !strings.Contains(prefer.Reason, "KVM") || prefer.KVMError == "" {
			t.Errorf("fallback reason must name KVM and its error: %+v", prefer)
		}
		if rerr == nil || !strings.Contains(rerr.Error(), "require-kvm") || !strings.Contains(rerr.Error(), "KVM probe failed") {
			t.Errorf("require-kvm with a failing KVM must be an error naming why, got %v (%+v)", rerr, require)
		}
	case AccelKVM:
		if rerr != nil || require.Accelerator != AccelKVM {
			t.Errorf("require-kvm with working KVM: %v %+v", rerr, require)
		}
	default:
		t.Fatalf("unexpected accelerator %q", prefer.Accelerator)
	}

	if _, err := ProbeAccelerator(ctx, ProbeOptions{Policy: "fast"}); err == nil || !strings.Contains(err.Error(), `"fast"`) {
		t.Errorf("unknown policy: got %v", err)
	}
}

// TestProbeAcceleratorThisMachine pins the behaviour of the project's machines:
// /dev/kvm present but unable to run guest code.
func TestProbeAcceleratorThisMachine(t *testing.T) {
	testutil.SkipIfShort(t, "QEMU")
	if _, err := os.Stat("/dev/kvm"); err != nil {
		t.Logf("no /dev/kvm: %v", err)
	}
	res, err := ProbeAccelerator(context.Background(), ProbeOptions{Policy: AccelPreferKVM, Timeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if os.Getenv("QK_EXPECT_KVM") == "1" {
		if res.Accelerator != AccelKVM {
			t.Fatalf("QK_EXPECT_KVM=1 but probe chose %s: %s", res.Accelerator, res.Reason)
		}
		return
	}
	if res.Accelerator != AccelTCG {
		t.Fatalf("expected TCG fallback on this machine (set QK_EXPECT_KVM=1 where KVM works), got %+v", res)
	}
}

func TestVersion(t *testing.T) {
	testutil.SkipIfShort(t, "QEMU")
	v, err := Version(context.Background(), "")
	if err != nil {
		t.Fatal(err)
	}
	if parts := strings.Split(v, "."); len(parts) < 2 {
		t.Fatalf("version %q", v)
	}
	for _, tc := range []struct{ in, want string }{
		{"QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\nCopyright", "7.2.22"},
		{"QEMU emulator version 9.0.0\n", "9.0.0"},
		{"QEMU emulator version 8.2\n", "8.2"},
	} {
		got, err := parseVersion(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("parseVersion(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
	if _, err := parseVersion("garbage"); err == nil {
		t.Error("parseVersion(garbage): want error")
	}
	if _, err := Version(context.Background(), "/nonexistent/qemu"); err == nil || !strings.Contains(err.Error(), "/nonexistent/qemu") {
		t.Errorf("missing binary: %v", err)
	}
}

// TestKVMModuleError: KVM backed by kvm_pvm alone (no hardware
// virtualization; stock kernels hang under it while the probe's boot
// sector runs) is refused with its reason; kvm_intel or kvm_amd, or no
// module information, leaves the decision to the probe VM.
func TestKVMModuleError(t *testing.T) {
	for _, tc := range []struct {
		modules []string
		refused bool
	}{
		{[]string{"kvm", "kvm_pvm"}, true},
		{[]string{"kvm", "kvm_intel"}, false},
		{[]string{"kvm", "kvm_amd"}, false},
		{[]string{"kvm", "kvm_intel", "kvm_pvm"}, false},
		{nil, false},
	} {
		dir := t.TempDir()
		for _, m := range tc.modules {
			if err := os.Mkdir(filepath.Join(dir, m), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		err := kvmModuleError(dir)
		if (err != nil) != tc.refused {
			t.Errorf("modules %v: err %v, want refused %v", tc.modules, err, tc.refused)
		}
		if err != nil && !strings.Contains(err.Error(), "kvm_pvm") {
			t.Errorf("modules %v: %v does not name kvm_pvm", tc.modules, err)
		}
	}
}
