package config

import (
	"encoding/json"
	"testing"
)

// FuzzDecode: any file is decoded or refused with an error, never a panic;
// a decoded configuration resolves (or is refused) without a panic, and
// re-encoded it decodes again.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{
		header,
		header + "maxVMs: 3\nnodeName: n1\n",
		header + "labels: {a: b}\ntaints: []\n",
		header + "reserved: {cpu: 500m, memory: 1Gi}\n",
		header + "images: {dir: /var/lib/x, gc: {highThreshold: 90%, lowThreshold: 80%}}\n",
		`{"apiVersion":"qemu-kubelet.io/v1alpha1","kind":"NodeConfiguration","maxVMs":3}`,
		header + "maxVMs: 3\nmaxVMs: 4\n",
		header + "unknown: 1\n",
		"kind: NodeConfiguration\n",
		"",
		"[",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Decode(data)
		if err != nil {
			if c != nil {
				t.Fatal("config and error both returned")
			}
			return
		}
		js, err := json.Marshal(c)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		if _, err := Decode(js); err != nil {
			t.Fatalf("decoded config does not decode again: %v\n%s", err, js)
		}
		_, _ = Resolve(c, Environment{Hostname: "host", HostIP: "10.0.0.1"})
	})
}
