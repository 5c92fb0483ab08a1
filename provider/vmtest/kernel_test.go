package vmtest

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// moduleOptions is the Kconfig option each module the Debian test image
// loads (hack/build-test-image.sh's MODS) is built in by in the minimal
// kernel (hack/testimage/minimal-kernel.config). Modules only the arm64
// image needs map to "": the minimal kernel is amd64's.
var moduleOptions = map[string]string{
	"virtio_ring": "CONFIG_VIRTIO", "virtio": "CONFIG_VIRTIO",
	"virtio_pci_legacy_dev": "", // VIRTIO_PCI_LEGACY is off: QEMU's devices are modern
	"virtio_pci_modern_dev": "CONFIG_VIRTIO_PCI", "virtio_pci": "CONFIG_VIRTIO_PCI",
	"virtio_mmio": "CONFIG_VIRTIO_MMIO",
	"failover":    "", "net_failover": "", // virtio_net's standby feature, unused
	"virtio_net": "CONFIG_VIRTIO_NET", "virtio_blk": "CONFIG_VIRTIO_BLK",
	"virtio_console": "CONFIG_VIRTIO_CONSOLE", "virtio_balloon": "CONFIG_VIRTIO_BALLOON",
	"pvpanic": "CONFIG_PVPANIC", "pvpanic-mmio": "CONFIG_PVPANIC_MMIO", "pvpanic-pci": "CONFIG_PVPANIC_PCI",
	"evdev": "CONFIG_INPUT_EVDEV", "button": "CONFIG_ACPI_BUTTON",
	"gpio-pl061": "", "gpio_keys": "", // arm64's power button
	"fat": "CONFIG_FAT_FS", "vfat": "CONFIG_VFAT_FS",
	"nls_cp437": "CONFIG_NLS_CODEPAGE_437", "nls_ascii": "CONFIG_NLS_ASCII", "nls_utf8": "CONFIG_NLS_UTF8",
	"cdrom": "CONFIG_BLK_DEV_SR", "isofs": "CONFIG_ISO9660_FS",
}

// TestMinimalKernelHasTheImagesModules: every module the test image loads
// into Debian's kernel is built into the minimal kernel, so an image booted
// with QK_TESTIMAGE_KERNEL=minimal does what the tests expect of it. A
// module added to the image's list without its option here and in the
// fragment fails this test (the kernel build itself only checks that the
// fragment's options survive Kconfig).
func TestMinimalKernelHasTheImagesModules(t *testing.T) {
	script, err := os.ReadFile(filepath.Join("..", "..", "hack", "build-test-image.sh"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?s)\nMODS="([^"]*)"`).FindSubmatch(script)
	if m == nil {
		t.Fatal(`hack/build-test-image.sh has no MODS="..." list`)
	}
	mods := strings.Fields(string(m[1]))
	if len(mods) < 10 {
		t.Fatalf("MODS lists %d modules: %q", len(mods), mods)
	}
	fragment, err := os.ReadFile(filepath.Join("..", "..", "hack", "testimage", "minimal-kernel.config"))
	if err != nil {
		t.Fatal(err)
	}
	on := map[string]bool{}
	for _, line := range strings.Split(string(fragment), "\n") {
		if name, ok := strings.CutSuffix(strings.TrimSpace(line), "=y"); ok && strings.HasPrefix(name, "CONFIG_") {
			on[name] = true
		}
	}
	for _, mod := range mods {
		opt, known := moduleOptions[mod]
		switch {
		case !known:
			t.Errorf("module %s of the test image has no option in moduleOptions: add it there and to hack/testimage/minimal-kernel.config", mod)
		case opt != "" && !on[opt]:
			t.Errorf("module %s: %s=y is not in hack/testimage/minimal-kernel.config", mod, opt)
		}
	}
	for _, opt := range []string{"CONFIG_PAGE_REPORTING", "CONFIG_BLK_DEV_INITRD", "CONFIG_SERIAL_8250_CONSOLE", "CONFIG_UNIX98_PTYS", "CONFIG_MAGIC_SYSRQ"} {
		if !on[opt] {
			t.Errorf("%s=y (free page reporting, the initramfs, the serial console, sshd's terminals, the panic image's sysrq) is not in the fragment", opt)
		}
	}
}
