package testutil

import (
	"strconv"
	"strings"
	"testing"
)

// smapsEntry renders one mapping of /proc/PID/smaps as the kernel does
// (the keys QEMUMemory reads among others it ignores).
func smapsEntry(header string, sizeKB, rssKB, pssKB, anonKB int) string {
	return header + "\n" +
		"Size:           " + strconv.Itoa(sizeKB) + " kB\n" +
		"KernelPageSize:        4 kB\n" +
		"Rss:            " + strconv.Itoa(rssKB) + " kB\n" +
		"Pss:            " + strconv.Itoa(pssKB) + " kB\n" +
		"Anonymous:      " + strconv.Itoa(anonKB) + " kB\n" +
		"THPeligible:    0\n" +
		"VmFlags: rd wr mr mw me ac sd\n"
}

// TestClassifySmaps: the mappings of a TCG QEMU 7.2 direct-booting a
// 256 MiB guest (taken from a real one, fewer libraries) land in their
// parts: the 256 MiB anonymous mapping is the guest's RAM, the rwx one
// TCG's buffer, the mapped initrd and the anonymous copy of the kernel
// (its size less the setup sectors) the blobs, a malloc arena of about
// the kernel's size (64 MiB aligned) the heap with [heap].
func TestClassifySmaps(t *testing.T) {
	const initrd = "/cache/initramfs-acpi.cpio.gz"
	smaps := smapsEntry("55b65c101000-55b65c698000 r-xp 00407000 fe:00 10166343                   /usr/bin/qemu-system-x86_64", 5724, 5404, 900, 0) +
		smapsEntry("55b679606000-55b67a491000 rw-p 00000000 00:00 0                          [heap]", 14892, 4680, 4680, 4680) +
		smapsEntry("7ff0c8000000-7ff0c8d6e000 rw-p 00000000 00:00 0 ", 13840, 7176, 7176, 7176) +
		smapsEntry("7ff0cde00000-7ff0dde00000 rw-p 00000000 00:00 0 ", 262144, 133120, 133120, 133120) +
		smapsEntry("7ff0de000000-7ff0dffff000 rwxp 00000000 00:00 0 ", 32764, 32764, 32764, 32764) +
		smapsEntry("7ff0e407d000-7ff0e4e00000 rw-p 00000000 00:00 0 ", 13836, 13836, 13836, 13836) +
		smapsEntry("7ff0e4e00000-7ff0e52ce000 r--p 00000000 fe:00 10388717                   "+initrd, 4920, 4920, 4920, 0) +
		smapsEntry("7ff0e7417000-7ff0e756d000 r-xp 00026000 fe:00 326269                     /usr/lib/x86_64-linux-gnu/libc.so.6", 1368, 1048, 40, 0) +
		smapsEntry("7ffd1a2e1000-7ffd1a302000 rw-p 00000000 00:00 0                          [stack]", 132, 60, 60, 60)
	got, err := ClassifySmaps([]byte(smaps), MemHints{
		GuestRAMBytes: 256 << 20,
		Blobs:         []Blob{{Path: "/cache/vmlinuz", Bytes: 14186432}, {Path: initrd, Bytes: 5037081}},
	})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]MemUse{
		PartGuestRAM: {RSS: 133120 << 10, PSS: 133120 << 10, Anon: 133120 << 10},
		PartTCG:      {RSS: 32764 << 10, PSS: 32764 << 10, Anon: 32764 << 10},
		PartBlobs:    {RSS: (13836 + 4920) << 10, PSS: (13836 + 4920) << 10, Anon: 13836 << 10},
		PartHeap:     {RSS: (4680 + 7176) << 10, PSS: (4680 + 7176) << 10, Anon: (4680 + 7176) << 10},
		PartFiles:    {RSS: (5404 + 1048) << 10, PSS: (900 + 40) << 10},
		PartOther:    {RSS: 60 << 10, PSS: 60 << 10, Anon: 60 << 10},
	}
	for _, p := range MemParts {
		if got[p] != want[p] {
			t.Errorf("%s: got %+v, want %+v", p, got[p], want[p])
		}
	}
	if len(got) != len(want) {
		t.Errorf("parts %v, want %v", got, want)
	}
}

// TestClassifySmapsRefusesGarbage: text that is not smaps is an error
// naming the line, not an empty breakdown.
func TestClassifySmapsRefusesGarbage(t *testing.T) {
	for _, in := range []string{
		"Rss: 4 kB\n",
		"hello world\n",
		"zz-55b65c101000 r-xp 00407000 fe:00 1 /x\n",
		"55b65c101000-55b65c698000 r-xp 00407000 fe:00 1 /x\nRss: 4x kB\n",
	} {
		if _, err := ClassifySmaps([]byte(in), MemHints{}); err == nil || !strings.Contains(err.Error(), "smaps line") {
			t.Errorf("%q: error %v, want one naming the smaps line", in, err)
		}
	}
}
