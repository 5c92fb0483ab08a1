package config

import (
	"errors"
	"fmt"
	"os"
	"strings"

	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// Load reads and strictly decodes the configuration file at path. It does
// not apply defaults or validate; use Resolve for that.
func Load(path string) (*NodeConfiguration, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config file: %w", err)
	}
	c, err := Decode(data)
	if err != nil {
		return nil, fmt.Errorf("config file %s: %w", path, err)
	}
	return c, nil
}

// Decode strictly decodes a YAML (or JSON) NodeConfiguration: unknown and
// duplicate fields are errors naming the field, and apiVersion/kind must
// name this format.
func Decode(data []byte) (*NodeConfiguration, error) {
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return nil, fmt.Errorf("parse YAML: %w", err)
	}
	c := &NodeConfiguration{}
	if len(strings.TrimSpace(string(js))) == 0 || string(js) == "null" {
		return nil, errors.New("empty file: want apiVersion " + APIVersion + " and kind " + Kind)
	}
	strict, err := sigsjson.UnmarshalStrict(js, c, sigsjson.DisallowDuplicateFields, sigsjson.DisallowUnknownFields)
	if err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	if len(strict) > 0 {
		msgs := make([]string, 0, len(strict))
		for _, e := range strict {
			msgs = append(msgs, e.Error())
		}
		return nil, fmt.Errorf("%s", strings.Join(msgs, "; "))
	}
	if c.APIVersion != APIVersion || c.Kind != Kind {
		return nil, fmt.Errorf("apiVersion %q, kind %q: want apiVersion %q and kind %q", c.APIVersion, c.Kind, APIVersion, Kind)
	}
	return c, nil
}
